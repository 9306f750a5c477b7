"""Scaled dot-product attention over named axes, with masks, additive bias and grouped-query heads."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import ops
from ..core import AxisSelector, NamedArray, dot
from ._attention_inputs import prepare, restore_output
from .dropout import Dropout


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
    `inference`.
    """
    fn = "dot_product_attention"
    inputs = prepare(QPos, KPos, HeadSize, query, key, value, mask, bias, fn)
    if scale is None:
        scale = 1.0 / math.sqrt(query.axis_size(HeadSize))
    score_dtype = jnp.float32 if upcast_softmax else None
    scores = dot(inputs.query, inputs.key, axis=HeadSize, precision=precision, preferred_element_type=score_dtype)
    scores = scores * scale
    if inputs.bias is not None:
        scores = scores + inputs.bias.astype(scores.dtype)
    weights = _masked_softmax(scores, KPos, inputs.mask)
    if dropout_rate > 0.0:
        weights = Dropout(dropout_rate)(weights, key=dropout_key, inference=inference)
    out = dot(weights.astype(inputs.value.dtype), inputs.value, axis=KPos, precision=precision)
    return restore_output(out, inputs, HeadSize)


def _masked_softmax(scores: NamedArray, KPos: AxisSelector, mask: NamedArray | None) -> NamedArray:
    """Softmax over KPos where masked entries get weight exactly 0 and fully masked rows are all 0."""
    if mask is None:
        return ops.softmax(scores, KPos)
    mask = mask.broadcast_to(scores.axes)
    lowest = jnp.finfo(scores.dtype).min
    kept = ops.where(mask, scores, lowest)
    row_max = ops.stop_gradient(ops.max(kept, KPos))
    # exp of the masked scores (not of the raw ones): a fully masked row then gives exp(0), never exp(inf),
    # whose zero cotangent would otherwise turn into NaN (0 * inf) in the backward pass.
    unnormalised = ops.where(mask, ops.exp(kept - row_max), 0.0)
    total = ops.sum(unnormalised, KPos)
    # A fully masked row has total 0: divide by 1 there so that the row (and its gradient) stays 0.
    return unnormalised / ops.where(total > 0, total, 1.0)
