"""Scaled dot-product attention over named axes, with masks, additive bias, attention sinks and grouped-query
heads."""

from __future__ import annotations

import functools
import math
from typing import cast

import jax
import jax.numpy as jnp

from .. import _ops as ops
from .._core import Axis, AxisSelector, NamedArray, axis_name, permute
from .._creation import arange as nt_arange
from .._reshape import concatenate
from ._attention_inputs import AttentionInputs, prepare, restore_output
from .dropout import Dropout
from .heads import HEADS, KV_HEADS, group_query_heads
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
    causal: bool = False,
    causal_offset: int = 0,
    query_blocks: int | None = None,
    sinks: NamedArray | None = None,
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

    `causal` also masks by index: query q sees key k when k <= q + causal_offset (a static int). The queries
    are then computed in `query_blocks` consecutive blocks, each against only the keys it can see, which skips
    about 3/8 of the score work at 4 blocks (1/4 at 2). The default is up to 4 blocks of at least 64 queries: 4
    were the fastest on CPU from 256 to 1024 positions, and at 128 positions 2 blocks give most of that gain for
    half the extra compile time. 1 computes all scores at once. Blocks give the same result up to float rounding.
    Dropout is drawn over all the scores at once, so with dropout there is one block.

    `sinks` (gpt-oss's attention sinks: a learned logit per query head, axis `heads`) joins each row's softmax as
    one more key that is never masked and has no value: it takes its share of the weight, so the weights of the
    real keys sum to less than one.
    """
    fn = "dot_product_attention"
    inputs = prepare(QPos, KPos, HeadSize, query, key, value, mask, bias, fn)
    if sinks is not None:
        sinks = _grouped_sinks(sinks, inputs, fn)
    if scale is None:
        scale = 1.0 / math.sqrt(query.axis_size(HeadSize))
    if not isinstance(causal_offset, int) or isinstance(causal_offset, bool):
        raise TypeError(f"{fn}: causal_offset must be a static int, got {causal_offset!r}")
    if query_blocks is not None and (not isinstance(query_blocks, int) or query_blocks < 1):
        raise ValueError(f"{fn}: query_blocks must be a positive int (or None for the default), got {query_blocks!r}")
    q_name, k_name = axis_name(QPos), axis_name(KPos)
    # Names, not sized axes: a block's positions are fewer.
    attend = functools.partial(
        _attend,
        QPos=q_name,
        KPos=k_name,
        HeadSize=HeadSize,
        scale=scale,
        upcast_softmax=upcast_softmax,
        dropout_rate=dropout_rate,
        dropout_key=dropout_key,
        inference=inference,
        precision=precision,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
    )
    if not causal:
        return attend(inputs)
    q_size, k_size = inputs.query.axis_size(QPos), inputs.key.axis_size(KPos)
    dropout = dropout_rate > 0.0 and not inference
    blocks = 1 if dropout else query_blocks or max(1, min(4, q_size // 64))
    rows = -(-q_size // blocks)
    pieces = []
    for start in range(0, q_size, rows):
        stop = min(start + rows, q_size)
        # Keys after the block's last query (plus the offset) are masked for all of its rows: leave them out.
        keys = min(k_size, max(1, stop + causal_offset))
        visible = nt_arange(Axis(k_name, keys)) <= nt_arange(Axis(q_name, stop - start), start=start) + causal_offset
        block = AttentionInputs(
            _cut(inputs.query, q_name, start, stop),
            _cut(inputs.key, k_name, 0, keys),
            _cut(inputs.value, k_name, 0, keys),
            visible if inputs.mask is None else visible & _cut(_cut(inputs.mask, q_name, start, stop), k_name, 0, keys),
            None if inputs.bias is None else _cut(_cut(inputs.bias, q_name, start, stop), k_name, 0, keys),
            inputs.query_names,
            inputs.Heads,
        )
        pieces.append(attend(block))
    return pieces[0] if len(pieces) == 1 else concatenate(q_name, pieces)


def _cut(x: NamedArray, name: str, start: int, stop: int) -> NamedArray:
    """x[start:stop] along `name` where x has that axis at a larger size (masks and biases may broadcast)."""
    if not x.has_axis(name) or (start == 0 and stop == x.axis_size(name)):
        return x
    return x[{name: slice(start, stop)}]


def _attend(
    inputs: AttentionInputs,
    QPos: AxisSelector,
    KPos: AxisSelector,
    HeadSize: AxisSelector,
    scale: float,
    upcast_softmax: bool,
    dropout_rate: float,
    dropout_key: jax.Array | None,
    inference: bool,
    precision: jax.lax.PrecisionLike,
    logits_soft_cap: float | None,
    sinks: NamedArray | None = None,
) -> NamedArray:
    """The attention of prepared inputs, every score at once."""
    score_dtype = jnp.float32 if upcast_softmax else None
    # Scores and the weighted sum are laid out as XLA's batched matmul produces them (shared axes, then the
    # left operand's own, then the right's: batch, heads, position, key_position), so that neither the
    # scores nor their gradients are transposed back and forth.
    scores = _matmul(inputs.query, inputs.key, HeadSize, precision, score_dtype)
    scores = soft_cap(scores * scale, logits_soft_cap)
    if inputs.bias is not None:
        scores = scores + inputs.bias.astype(scores.dtype)
    if sinks is None:
        weights = _masked_softmax(scores, KPos, inputs.mask)
    else:
        weights = _softmax_with_sink(scores, KPos, inputs.mask, sinks)
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


def _grouped_sinks(sinks: NamedArray, inputs: AttentionInputs, fn: str) -> NamedArray:
    """The sinks (axis heads) checked, and split like the query's heads under grouped-query attention."""
    if not isinstance(sinks, NamedArray) or sinks.axis_names != (HEADS,):
        raise ValueError(f"{fn}: sinks must be a NamedArray with the one axis {HEADS!r}, got {sinks!r}")
    if inputs.Heads is not None:
        if sinks.axis_size(HEADS) != inputs.Heads.size:
            raise ValueError(f"{fn}: {sinks.axis_size(HEADS)} sinks for {inputs.Heads.size} query heads")
        return group_query_heads(sinks, inputs.key.resolve_axis(KV_HEADS))
    return sinks


def _softmax_with_sink(scores: NamedArray, KPos: AxisSelector, mask: NamedArray | None, sinks: NamedArray):
    """The masked softmax over KPos with each row's sink logit as one more, always visible, entry (then dropped)."""
    k = scores.axis_index(KPos)
    rest = [a for a in scores.axes if a.name != axis_name(KPos)]
    sink = sinks.astype(scores.dtype).broadcast_to(rest)
    sink = jnp.expand_dims(permute(sink, tuple(a.name for a in rest)).array, k)
    with_sink = jnp.concatenate([scores.array, sink], axis=k)
    visible = jnp.ones(scores.array.shape, bool) if mask is None else mask.broadcast_to(scores.axes).array
    visible = jnp.concatenate([visible, jnp.ones(sink.shape, bool)], axis=k)
    weights = cast(jax.Array, _softmax_where(with_sink, visible, k))  # a custom_vjp: its generic result
    return NamedArray(jax.lax.slice_in_dim(weights, 0, scores.array.shape[k], axis=k), scores.axes)


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
