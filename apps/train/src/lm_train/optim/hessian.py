"""Estimators of a loss's Hessian diagonal, for second-order optimizers (Sophia-H and Sophia-G use them).

`hutchinson_diagonal`: u * Hu with a Hessian-vector product (unbiased; may be negative where the loss is not
convex). `gauss_newton_bartlett_diagonal`: B * g_hat**2, with g_hat the gradient of the mean loss on labels
sampled from the model's own softmax (never negative). Both work on any pytree of float arrays, equinox Modules
and NamedArrays included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

import named_tensors as nt

PyTree = Any


def _random_like(params: PyTree, key: jax.Array, distribution: Literal["normal", "rademacher"]) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    if distribution == "normal":
        draw = jax.random.normal
    elif distribution == "rademacher":
        draw = jax.random.rademacher
    else:
        raise ValueError(f"distribution must be 'normal' or 'rademacher', got {distribution!r}")
    return jax.tree_util.tree_unflatten(treedef, [draw(keys[i], x.shape, x.dtype) for i, x in enumerate(leaves)])


def hutchinson_diagonal(
    loss_fn: Callable[[PyTree], jax.Array],
    params: PyTree,
    key: jax.Array,
    *,
    distribution: Literal["normal", "rademacher"] = "normal",
) -> PyTree:
    """Sophia-H's estimate of diag(H) of loss_fn at params: u * (H u), u ~ N(0, I) or Rademacher.

    params: a pytree of float arrays (e.g. `eqx.filter(model, eqx.is_inexact_array)`); loss_fn(params) is a
    scalar. H u is a Hessian-vector product taken reverse-over-reverse, grad(<grad loss, u>): forward mode
    would be cheaper, but it cannot pass through jax.custom_vjp functions, which fused attention and losses
    use. The estimate is unbiased; it may be negative where the loss is not convex.
    """
    u = _random_like(params, key, distribution)

    def directional_derivative(p: PyTree) -> jax.Array:
        grads = jax.grad(loss_fn)(p)
        products = jax.tree_util.tree_map(lambda g, v: jnp.sum(g * v).astype(jnp.float32), grads, u)
        return sum(jax.tree_util.tree_leaves(products), jnp.zeros((), jnp.float32))

    hu = jax.grad(directional_derivative)(params)
    return jax.tree_util.tree_map(lambda a, b: a * b, u, hu)


def sampled_label_loss(
    logits: jax.Array | nt.NamedArray,
    key: jax.Array,
    *,
    mask: jax.Array | nt.NamedArray | None = None,
    vocab_axis: str = "vocab",
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of logits against labels sampled from softmax(logits), and the number of tokens.

    Plain-array logits have the vocabulary last; NamedArray logits name it (`vocab_axis`). mask (bool or
    0/1 weights over the logits' other axes) drops tokens. The samples carry no gradient.
    """
    if isinstance(logits, nt.NamedArray):
        Vocab = logits.resolve_axis(vocab_axis)
        logits = nt.permute(logits, (..., Vocab.name))
        other = logits.axes[:-1]
        raw = logits.array
        if isinstance(mask, nt.NamedArray):
            mask = nt.broadcast_to(mask, other).array
    else:
        raw = logits
    raw = raw.astype(jnp.float32)
    labels = jax.random.categorical(key, jax.lax.stop_gradient(raw), axis=-1)
    logp = jax.nn.log_softmax(raw, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll), jnp.asarray(nll.size, jnp.float32)
    weights = jnp.broadcast_to(jnp.asarray(mask).astype(jnp.float32), nll.shape)
    count = jnp.sum(weights)
    return jnp.sum(nll * weights) / jnp.maximum(count, 1.0), count


def gauss_newton_bartlett_diagonal(
    logits_fn: Callable[[PyTree], jax.Array | nt.NamedArray],
    params: PyTree,
    key: jax.Array,
    *,
    mask: jax.Array | nt.NamedArray | None = None,
    vocab_axis: str = "vocab",
) -> PyTree:
    """Sophia-G's estimate of diag(H): B * g_hat * g_hat (Algorithm 2 of the paper).

    logits_fn(params) gives the model's logits on a batch; labels y_hat are sampled from softmax(logits) with
    `key`; g_hat is the gradient of the mean cross-entropy against y_hat (over the tokens `mask` keeps) and B
    the number of those tokens. The estimate is never negative.
    """

    def loss(p: PyTree) -> tuple[jax.Array, jax.Array]:
        return sampled_label_loss(logits_fn(p), key, mask=mask, vocab_axis=vocab_axis)

    g_hat, count = jax.grad(loss, has_aux=True)(params)
    return jax.tree_util.tree_map(lambda g: count.astype(g.dtype) * g * g, g_hat)
