"""Cross-entropy from hidden states and an unembedding matrix, vocabulary chunk by chunk.

The logits are produced one vocabulary chunk at a time with an online logsumexp, so the full float32
(tokens x vocab) logits never exist, in the forward pass nor (thanks to a custom VJP that recomputes each
chunk) in the backward pass.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import jax
import jax.numpy as jnp

from .._core import AxisSelector, NamedArray, axis_name, permute
from .loss import Reduction, check_targets, loss_from_logsumexp


def _chunk_logits(h, w, j, targets, vocab_size, block_size, precision):
    """float32 logits of vocabulary chunk j, padded columns at -inf, and the target one-hot of the chunk."""
    w_block = jax.lax.dynamic_slice_in_dim(w, j * block_size, block_size, axis=0)
    logits = jnp.einsum("ne,ve->nv", h, w_block, precision=precision, preferred_element_type=jnp.float32)
    column = (j * block_size + jnp.arange(block_size, dtype=jnp.int32))[None, :]
    logits = jnp.where(column < vocab_size, logits, -jnp.inf)
    is_target = (column == targets[:, None]) & (column < vocab_size)
    return w_block, logits, is_target


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _lse_and_target_logit(h, w, targets, vocab_size, block_size, precision):
    """(logsumexp over the vocabulary, logit of the target) per row of h, one chunk of w at a time."""
    return _forward(h, w, targets, vocab_size, block_size, precision)[0]


def _forward(h, w, targets, vocab_size, block_size, precision):
    n = h.shape[0]

    def step(carry, j):
        running_max, running_sum, target_logit = carry
        _, logits, is_target = _chunk_logits(h, w, j, targets, vocab_size, block_size, precision)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=1)
        target_logit = target_logit + jnp.sum(jnp.where(is_target, logits, 0.0), axis=1)
        return (new_max, running_sum, target_logit), None

    # Chunk 0 always holds a real column, so the running max is finite from the first step on.
    init = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    (running_max, running_sum, target_logit), _ = jax.lax.scan(step, init, jnp.arange(w.shape[0] // block_size))
    lse = running_max + jnp.log(running_sum)
    return (lse, target_logit), (h, w, targets, lse)


def _backward(vocab_size, block_size, precision, residuals, cotangents):
    h, w, targets, lse = residuals
    d_lse, d_target = cotangents

    def step(d_h, j):
        w_block, logits, is_target = _chunk_logits(h, w, j, targets, vocab_size, block_size, precision)
        probs = jnp.exp(logits - lse[:, None])
        d_logits = d_lse[:, None] * probs + jnp.where(is_target, d_target[:, None], 0.0)
        d_logits = d_logits.astype(h.dtype)
        d_h = d_h + jnp.einsum("nv,ve->ne", d_logits, w_block, precision=precision, preferred_element_type=jnp.float32)
        d_w_block = jnp.einsum("nv,ne->ve", d_logits, h, precision=precision, preferred_element_type=jnp.float32)
        return d_h, d_w_block.astype(w.dtype)

    d_h, d_w_blocks = jax.lax.scan(step, jnp.zeros(h.shape, jnp.float32), jnp.arange(w.shape[0] // block_size))
    return d_h.astype(h.dtype), d_w_blocks.reshape(w.shape), None


_lse_and_target_logit.defvjp(_forward, _backward)


def blockwise_cross_entropy_loss(
    hidden: NamedArray,
    unembed_weight: NamedArray,
    Embed: AxisSelector,
    Vocab: AxisSelector,
    targets: NamedArray,
    *,
    block_size: int,
    mask: NamedArray | None = None,
    reduction: Reduction = "mean",
    z_loss_weight: float = 0.0,
    precision: jax.lax.PrecisionLike = None,
) -> NamedArray:
    """cross_entropy_loss(dot(hidden, unembed_weight, axis=Embed), Vocab, targets, ...), computed in
    vocabulary chunks of block_size without materialising the logits.

    hidden: the targets' axes plus Embed; unembed_weight: exactly (Vocab, Embed), in any order (e.g. an
    Embedding's or a Linear's weight). Logits are accumulated in float32. Same semantics as
    cross_entropy_loss for mask, reduction and z-loss.
    """
    fn = "blockwise_cross_entropy_loss"
    for x, role in ((hidden, "hidden"), (unembed_weight, "unembed_weight")):
        if not isinstance(x, NamedArray):
            raise TypeError(f"{fn}: {role} must be a NamedArray, got {type(x).__name__}")
    e_name, v_name = axis_name(Embed), axis_name(Vocab)
    if set(unembed_weight.axis_names) != {e_name, v_name} or unembed_weight.ndim != 2:
        raise ValueError(
            f"{fn}: unembed_weight must have exactly the axes ({v_name!r}, {e_name!r}), got {unembed_weight.axis_names}"
        )
    V = unembed_weight.resolve_axis(Vocab)
    E = hidden.resolve_axis(Embed)
    unembed_weight.axis_index(E)
    check_targets(targets, V, fn)
    if set(hidden.axis_names) - {e_name} != set(targets.axis_names):
        raise ValueError(
            f"{fn}: hidden axes {hidden.axis_names} must be the targets' axes {targets.axis_names} plus {e_name!r}"
        )
    if hidden.dtype != unembed_weight.dtype:
        raise TypeError(f"{fn}: hidden dtype {hidden.dtype} differs from weight dtype {unembed_weight.dtype}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{fn}: block_size must be a positive int, got {block_size!r}")
    block_size = min(block_size, V.size)
    padded = -(-V.size // block_size) * block_size

    h = permute(hidden, (*targets.axis_names, e_name)).array.reshape(-1, E.size)
    w = permute(unembed_weight, (v_name, e_name)).array
    w = jnp.pad(w, ((0, padded - V.size), (0, 0)))
    flat_targets = targets.array.reshape(-1).astype(jnp.int32)
    lse, target_logit = cast(  # a custom_vjp: type checkers see its generic result
        tuple[jax.Array, jax.Array], _lse_and_target_logit(h, w, flat_targets, V.size, block_size, precision)
    )
    lse = NamedArray(lse.reshape(targets.array.shape), targets.axes)
    target_logit = NamedArray(target_logit.reshape(targets.array.shape), targets.axes)
    return loss_from_logsumexp(
        lse, target_logit, targets, V.size, mask=mask, reduction=reduction, z_loss_weight=z_loss_weight, fn=fn
    )
