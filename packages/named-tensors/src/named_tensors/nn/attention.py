"""Scaled dot-product attention over named axes, with masks, additive bias and grouped-query heads."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import _ops as ops
from .._core import Axis, AxisSelector, NamedArray, axis_name
from ._attention_inputs import prepare, restore_output
from .dropout import Dropout
from .softcap import soft_cap


def dot_product_attention(
    QPos: AxisSelector,
    KPos: AxisSelector,
    HeadSize: AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: NamedArray | None = None,
    bias: NamedArray | None = None,
    *,
    upcast_softmax: bool = True,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    inference: bool = False,
    precision: jax.lax.PrecisionLike = None,
    logits_soft_cap: float | None = None,
) -> NamedArray:
    """softmax(query·key * scale + bias, masked, over KPos) · value; the output has the query's axes.

    query: (..., QPos, heads, HeadSize); key/value: (..., KPos, heads or kv_heads, HeadSize). Axes other
    than the positions and HeadSize are matched by name (batch, heads, ...). Grouped-query attention: when
    key/value have `kv_heads` and the query has `heads` (a multiple of it), query head h uses kv head
    h // (heads / kv_heads), as in Hugging Face; K/V are not repeated. A query may also carry
    (`kv_heads`, `q_per_group`) axes itself.

    mask: boolean, True = may attend, any subset of the score axes (batch, heads, QPos, KPos), broadcast
    by name. bias: added to the scores (e.g. ALiBi), broadcast the same way. A query row whose keys are
    all masked gets an all-zero output (not NaN, not a uniform average). scale defaults to
    1/sqrt(head size). With upcast_softmax the scores and softmax are float32 and the weights are cast to
    the value dtype before the weighted sum. Dropout on the attention weights needs `dropout_key` unless
    `inference`. `logits_soft_cap` squashes the scaled scores to (-cap, cap) with cap * tanh(s / cap) before the
    bias and the mask (Gemma 2).
    """
    fn = "dot_product_attention"
    inputs = prepare(QPos, KPos, HeadSize, query, key, value, mask, bias, fn)
    if scale is None:
        scale = 1.0 / math.sqrt(query.axis_size(HeadSize))
    score_dtype = jnp.float32 if upcast_softmax else None
    # Scores and the weighted sum are laid out as XLA's batched matmul produces them (shared axes, then the
    # left operand's own, then the right's: batch, heads, position, key_position), so that neither the
    # scores nor their gradients are transposed back and forth.
    scores = _matmul(inputs.query, inputs.key, HeadSize, precision, score_dtype)
    scores = soft_cap(scores * scale, logits_soft_cap)
    if inputs.bias is not None:
        scores = scores + inputs.bias.astype(scores.dtype)
    weights = _masked_softmax(scores, KPos, inputs.mask)
    if dropout_rate > 0.0:
        weights = Dropout(dropout_rate)(weights, key=dropout_key, inference=inference)
    out = _matmul(weights.astype(inputs.value.dtype), inputs.value, KPos, precision, None)
    return restore_output(out, inputs, HeadSize)


def _matmul(
    a: NamedArray, b: NamedArray, contract: AxisSelector, precision: jax.lax.PrecisionLike, preferred_element_type
) -> NamedArray:
    """Contract a and b over `contract`, output in dot_general's order: shared axes, a's own, b's own."""
    c = axis_name(contract)
    b_names = set(b.axis_names)
    shared = [x for x in a.axes if x.name in b_names and x.name != c]
    shared_names = {x.name for x in shared} | {c}
    a_own = [x for x in a.axes if x.name not in shared_names]
    b_own = [x for x in b.axes if x.name not in shared_names]
    for x in shared:  # sizes must agree
        if b.axis_size(x.name) != x.size:
            raise ValueError(f"axis {x.name!r} has size {x.size} in one operand and {b.axis_size(x.name)} in the other")
    out_axes: list[Axis] = [*shared, *a_own, *b_own]
    letters = {n: chr(ord("a") + i) for i, n in enumerate([*(x.name for x in out_axes), c])}
    spec = "{},{}->{}".format(
        "".join(letters[n] for n in a.axis_names),
        "".join(letters[n] for n in b.axis_names),
        "".join(letters[x.name] for x in out_axes),
    )
    result = jnp.einsum(spec, a.array, b.array, precision=precision, preferred_element_type=preferred_element_type)
    return NamedArray(result, out_axes)


def _masked_softmax(scores: NamedArray, KPos: AxisSelector, mask: NamedArray | None) -> NamedArray:
    """Softmax over KPos where masked entries get weight exactly 0 and fully masked rows are all 0."""
    if mask is None:
        return ops.softmax(scores, KPos)
    mask = mask.broadcast_to(scores.axes)
    return NamedArray(_softmax_where(scores.array, mask.array, scores.axis_index(KPos)), scores.axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _softmax_where(x: jax.Array, mask: jax.Array, axis: int) -> jax.Array:
    kept = jnp.where(mask, x, jnp.finfo(x.dtype).min)
    row_max = jnp.max(kept, axis=axis, keepdims=True)
    # exp of the masked scores (not of the raw ones): a fully masked row gives exp(0), never exp(inf).
    unnormalised = jnp.where(mask, jnp.exp(kept - row_max), 0.0)
    total = jnp.sum(unnormalised, axis=axis, keepdims=True)
    # A fully masked row has total 0: divide by 1 there so that the row stays 0.
    return unnormalised / jnp.where(total > 0, total, 1.0)


def _softmax_where_fwd(x: jax.Array, mask: jax.Array, axis: int):
    y = _softmax_where(x, mask, axis)
    return y, y  # the output is the only residual, as in jax.nn.softmax


def _softmax_where_bwd(axis: int, y: jax.Array, g: jax.Array):
    # Masked entries and fully masked rows have y == 0, so their gradient is exactly 0.
    grad_x = y * (g - jnp.sum(g * y, axis=axis, keepdims=True))
    return grad_x, None


_softmax_where.defvjp(_softmax_where_fwd, _softmax_where_bwd)
