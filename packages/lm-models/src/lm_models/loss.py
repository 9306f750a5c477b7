"""The causal-LM objective: cross-entropy of each next token, from named-tensors' cross-entropy losses."""

from __future__ import annotations

from typing import Any, Literal, overload

import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import NamedArray

from .kernel_platform import kernel_platform
from .model import POSITION, LmHeadModel


def next_token_targets(input_ids: NamedArray) -> tuple[NamedArray, NamedArray]:
    """Targets (the id at t + 1 for each position t) and a mask that is False at the last position."""
    Pos = input_ids.resolve_axis(POSITION)
    targets = nt.roll(input_ids, -1, POSITION)
    not_last = nt.arange(Pos, dtype=jnp.int32) < Pos.size - 1
    return targets, not_last


DEFAULT_BLOCK_SIZE = 2048  # vocabulary entries per block when blockwise=True names no size
LARGE_VOCABULARY = 32768  # from here up, an accelerator scores the vocabulary blockwise unless told otherwise
ACCELERATOR_BLOCK_SIZE = 8192


def vocabulary_block_size(model: Any, platform: str | None = None) -> int | None:
    """The block size next_token_loss scores the vocabulary with by default (None: all at once).

    The config's `cross_entropy_block_size` when set. Otherwise, on a GPU or TPU (`platform`; by default jax's
    backend, or the one `kernels_for` names) with a vocabulary of 32768 or more, 8192: there the full logits
    are a step's largest buffer. A model that soft-caps its logits (Gemma 2) is scored all at once unless its
    config asks.
    """
    size = getattr(model.config, "cross_entropy_block_size", None)
    if size is not None:
        return size
    if (platform or kernel_platform()) == "cpu" or model.Vocab.size < LARGE_VOCABULARY:
        return None
    return None if model.logits_soft_cap() is not None else ACCELERATOR_BLOCK_SIZE


# The overloads tell type checkers what `with_aux` returns: the loss alone, or the loss and its auxiliary losses.
@overload
def next_token_loss(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    loss_mask: NamedArray | None = None,
    attn_mask: NamedArray | None = None,
    positions: NamedArray | None = None,
    key: jax.Array | None = None,
    reduction: Literal["mean", "sum"] | None = "mean",
    z_loss_weight: float = 0.0,
    blockwise: bool | None = None,
    block_size: int | None = None,
    with_aux: Literal[False] = False,
    targets: NamedArray | None = None,
    router_load: bool = False,
) -> NamedArray: ...
@overload
def next_token_loss(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    loss_mask: NamedArray | None = None,
    attn_mask: NamedArray | None = None,
    positions: NamedArray | None = None,
    key: jax.Array | None = None,
    reduction: Literal["mean", "sum"] | None = "mean",
    z_loss_weight: float = 0.0,
    blockwise: bool | None = None,
    block_size: int | None = None,
    with_aux: Literal[True],
    targets: NamedArray | None = None,
    router_load: bool = False,
) -> tuple[NamedArray, dict[str, jax.Array]]: ...
@overload
def next_token_loss(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    loss_mask: NamedArray | None = None,
    attn_mask: NamedArray | None = None,
    positions: NamedArray | None = None,
    key: jax.Array | None = None,
    reduction: Literal["mean", "sum"] | None = "mean",
    z_loss_weight: float = 0.0,
    blockwise: bool | None = None,
    block_size: int | None = None,
    with_aux: bool = False,
    targets: NamedArray | None = None,
    router_load: bool = False,
) -> NamedArray | tuple[NamedArray, dict[str, jax.Array]]: ...
def next_token_loss(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    loss_mask: NamedArray | None = None,
    attn_mask: NamedArray | None = None,
    positions: NamedArray | None = None,
    key: jax.Array | None = None,
    reduction: Literal["mean", "sum"] | None = "mean",
    z_loss_weight: float = 0.0,
    blockwise: bool | None = None,
    block_size: int | None = None,
    with_aux: bool = False,
    targets: NamedArray | None = None,
    router_load: bool = False,
) -> NamedArray | tuple[NamedArray, dict[str, jax.Array]]:
    """Cross-entropy of predicting input_ids[t + 1] at every position t; the last position is not scored.

    loss_mask (bool or float weights, over input_ids' axes or a subset) weights the prediction made AT each
    position, so loss_mask[t] = 0 drops the loss of predicting token t + 1. "mean" divides by the total
    weight of the scored positions. blockwise=True scores the vocabulary in chunks of `block_size` (default 2048)
    from the final hidden states, so the full (position, vocab) float32 logits never exist at once; None (the
    default) follows the model config's `cross_entropy_block_size` (see `vocabulary_block_size`).
    attn_mask (True = may attend) is combined with the causal mask, and `positions` replaces each token's
    position, as in the model call (for packed sequences: nt.nn.packed_causal_mask and restarting positions).

    with_aux=True returns (loss, aux): `aux` holds the model's auxiliary losses, unweighted (e.g. a mixture of
    experts' "router_aux_loss" and "router_z_loss", each a float32 scalar: log them), and `loss` is the
    cross-entropy plus each auxiliary loss times its weight in model.config.aux_loss_weights() (optimise it).
    It needs reduction="mean". with_aux=False (the default) is the cross-entropy alone, for every model.
    With router_load (and with_aux), `aux` also holds a mixture's nt.nn.ROUTER_LOAD, which adds nothing to the loss.

    `targets` (over input_ids' axes) gives the id each position predicts, for input_ids whose positions were
    reordered (context parallelism's load balance): then only loss_mask decides which positions are scored.
    """
    # Holds only `positions`, passed only when given (MPT and Backpack take no such keyword).
    extra: dict[str, Any] = {} if positions is None else {"positions": positions}
    if blockwise is None:
        chosen = vocabulary_block_size(model)
        blockwise, block_size = chosen is not None, block_size or chosen
    block_size = block_size or DEFAULT_BLOCK_SIZE
    if targets is None:
        targets, mask = next_token_targets(input_ids)
    else:
        mask = nt.ones_like(targets, dtype=jnp.bool_)
    if loss_mask is not None:
        mask = mask & loss_mask if loss_mask.dtype == jnp.bool_ else mask.astype(loss_mask.dtype) * loss_mask
    if with_aux:
        if reduction != "mean":
            raise ValueError(
                f"next_token_loss(with_aux=True) adds mean auxiliary losses: use reduction='mean', not {reduction!r}"
            )
        if router_load:
            extra["router_load"] = True
        hidden, aux = model.activations_and_aux(input_ids, attn_mask, key=key, **extra)
    else:
        hidden, _ = model.activations(input_ids, attn_mask, key=key, **extra)
        aux = {}
    loss = _cross_entropy(model, hidden, targets, mask, reduction, z_loss_weight, blockwise, block_size)
    if not with_aux:
        return loss
    weights = model.config.aux_loss_weights()
    for name, value in aux.items():
        weight = weights.get(name, 0.0)
        if weight:
            loss = loss + weight * value.astype(loss.dtype)
    return loss, aux


def _cross_entropy(model, hidden, targets, mask, reduction, z_loss_weight, blockwise, block_size) -> NamedArray:
    if not blockwise:
        logits = model.logits_from_activations(hidden)
        return nt.nn.cross_entropy_loss(
            logits, model.Vocab, targets, mask=mask, reduction=reduction, z_loss_weight=z_loss_weight
        )
    if model.logits_soft_cap() is not None:
        raise ValueError(
            f"next_token_loss(blockwise=True) scores raw logits, but this {model.config.model_type} model soft-caps "
            "its logits (final_logit_softcapping); use blockwise=False (in a config: cross_entropy_block_size: null)"
        )
    head = model.unembedding().astype(hidden.dtype)
    return nt.nn.blockwise_cross_entropy_loss(
        hidden,
        head,
        model.config.Embed,
        model.Vocab,
        targets,
        mask=mask,
        reduction=reduction,
        z_loss_weight=z_loss_weight,
        block_size=block_size,
    )
