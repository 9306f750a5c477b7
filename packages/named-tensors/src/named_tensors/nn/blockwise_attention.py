"""Blockwise (flash-style) attention over named axes: the same result as dot_product_attention, with
memory linear in sequence length in the forward and the backward pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import jax
import jax.numpy as jnp

from .._core import Axis, AxisSelector, NamedArray, axis_name, broadcast_to
from ._attention_inputs import prepare, restore_output
from ._flash import Extras, FlashConfig, flash_attention


def _layout(x: NamedArray, groups: Sequence[Sequence[Axis]]) -> jax.Array:
    """x as a positional array with one dimension per group of axes: the group's axes flattened, or size 1
    where x has none of them (x is broadcast over the rest of a group it partly has)."""
    present = [any(x.has_axis(a.name) for a in g) for g in groups]
    full = broadcast_to(x, [a for g, p in zip(groups, present, strict=True) if p for a in g])
    shape = [math.prod(a.size for a in g) if p else 1 for g, p in zip(groups, present, strict=True)]
    return full.array.reshape(shape)


def _pad_to(x: jax.Array | None, axis: int, length: int) -> jax.Array | None:
    if x is None or x.shape[axis] in (1, length):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis % x.ndim] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def _check_segment_ids(ids: NamedArray, allowed: set[str], needed: str, role: str, fn: str) -> None:
    if not isinstance(ids, NamedArray) or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{fn}: {role} must be an integer NamedArray, got {ids!r}")
    extra = [n for n in ids.axis_names if n not in allowed]
    if not ids.has_axis(needed) or extra:
        raise ValueError(
            f"{fn}: {role} must have the axis {needed!r} and otherwise only axes among {sorted(allowed)}; "
            f"got {ids.axis_names}"
        )


def blockwise_attention(
    QPos: AxisSelector,
    KPos: AxisSelector,
    HeadSize: AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: NamedArray | None = None,
    bias: NamedArray | None = None,
    *,
    causal: bool = False,
    causal_offset: int | jax.Array = 0,
    query_segment_ids: NamedArray | None = None,
    key_segment_ids: NamedArray | None = None,
    prefix_length: NamedArray | int | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
    inference: bool = False,
    block_size: int = 128,
    key_block_size: int | None = None,
    precision: jax.lax.PrecisionLike = None,
    sliding_window: int | jax.Array | None = None,
    logits_soft_cap: float | None = None,
) -> NamedArray:
    """Attention computed block by block with an online softmax; equals

        dot_product_attention(QPos, KPos, HeadSize, query, key, value,
                              mask=and_masks(mask, visible, segment_mask(query_segment_ids, key_segment_ids)),
                              bias=bias, upcast_softmax=True, scale=scale)

    where `visible` is None without `causal`, causal_mask(QPos, KPos, offset=causal_offset) with it, and
    prefix_lm_mask(QPos, KPos, prefix_length, offset=causal_offset) with it and a `prefix_length` (an int
    or per batch row). With `causal` and a `sliding_window` (an int, or a traced 0-d int such as a per-layer
    value inside a scan; <= 0 means none), `visible` is also and-ed with sliding_window_mask(QPos, KPos,
    sliding_window, offset=causal_offset), and key blocks outside every query's window are skipped, so the
    cost is linear in the window, not the sequence. `logits_soft_cap` works as in dot_product_attention.
    Same axes, grouped-query rule and fully-masked-row zeros as dot_product_attention.
    The causal/prefix rule and segment ids are evaluated per block, so they cost no (QPos, KPos) memory;
    `mask` and `bias` are sliced per block (a (batch, KPos) padding mask or a (heads, KPos) ALiBi bias
    stays linear in length; a full (QPos, KPos) one is quadratic, as given); `bias` is differentiable.
    Sequences need not be multiples of the block sizes (block_size for queries, key_block_size, default
    block_size, for keys). Dropout on the attention weights (rate, key, inference) works as in
    dot_product_attention, though with another random draw for the same key. Differentiable in reverse
    mode only (custom VJP).
    """
    fn = "blockwise_attention"
    inputs = prepare(QPos, KPos, HeadSize, query, key, value, mask, bias, fn)
    q, k, v = inputs.query, inputs.key, inputs.value
    q_name, k_name, d_name = axis_name(QPos), axis_name(KPos), axis_name(HeadSize)
    for size, what in ((block_size, "block_size"), (key_block_size or 1, "key_block_size")):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{fn}: {what} must be a positive int, got {size!r}")
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError(f"{fn}: give both query_segment_ids and key_segment_ids, or neither")

    QP, KP, D = q.resolve_axis(q_name), k.resolve_axis(k_name), q.resolve_axis(d_name)
    shared = [a for a in k.axes if a.name not in (k_name, d_name)]
    shared_names = {a.name for a in shared}
    value_features = [a for a in v.axes if a.name != k_name and a.name not in shared_names]
    if len(value_features) != 1 or {a.name for a in v.axes} != shared_names | {k_name, value_features[0].name}:
        raise ValueError(
            f"{fn}: value must have the key's axes {[a.name for a in shared]} plus {k_name!r} and one feature "
            f"axis; got {v.axis_names}"
        )
    (VF,) = value_features
    for a in shared:
        v.axis_index(a)
    query_only = [a for a in q.axes if a.name not in shared_names | {q_name, d_name}]

    if scale is None:
        scale = 1.0 / math.sqrt(D.size)
    bq = min(block_size, QP.size)
    bk = min(key_block_size or block_size, KP.size)
    tq = -(-QP.size // bq) * bq
    tk = -(-KP.size // bk) * bk

    # Shared axes (batch, kv heads) stay separate dimensions so that each keeps its own sharding.
    each = [[a] for a in shared]
    q_arr = _pad_to(_layout(q, [*each, query_only, [QP], [D]]), -2, tq)
    k_arr = _pad_to(_layout(k, [*each, [KP], [D]]), -2, tk)
    v_arr = _pad_to(_layout(v, [*each, [KP], [VF]]), -2, tk)
    score_groups = [*each, query_only, [QP], [KP]]
    mask_arr = None if inputs.mask is None else _pad_to(_pad_to(_layout(inputs.mask, score_groups), -2, tq), -1, tk)
    bias_arr = None
    if inputs.bias is not None:
        bias_arr = _layout(inputs.bias, score_groups)
        bias_arr = _pad_to(_pad_to(bias_arr, -2, tq), -1, tk)
    q_seg = k_seg = None
    if query_segment_ids is not None:
        assert key_segment_ids is not None  # both or neither: checked above
        batch_like = {a.name for a in (*shared, *query_only)}
        _check_segment_ids(query_segment_ids, batch_like | {q_name}, q_name, "query_segment_ids", fn)
        _check_segment_ids(key_segment_ids, shared_names | {k_name}, k_name, "key_segment_ids", fn)
        q_seg = _pad_to(_layout(query_segment_ids.astype(jnp.int32), [*each, query_only, [QP]]), -1, tq)
        k_seg = _pad_to(_layout(key_segment_ids.astype(jnp.int32), [*each, [KP]]), -1, tk)

    prefix = None
    if prefix_length is not None:
        if not causal:
            raise ValueError(f"{fn}: prefix_length only makes sense with causal=True (prefix-LM)")
        if not isinstance(prefix_length, NamedArray):
            prefix_length = NamedArray(jnp.asarray(prefix_length, jnp.int32), ())
        batch_like = {a.name for a in (*shared, *query_only)}
        extra = [n for n in prefix_length.axis_names if n not in batch_like]
        if extra or not jnp.issubdtype(prefix_length.dtype, jnp.integer):
            raise ValueError(
                f"{fn}: prefix_length must be an int or an integer NamedArray over the batch-like axes "
                f"{sorted(batch_like)}; got {prefix_length!r}"
            )
        prefix = _layout(prefix_length.astype(jnp.int32), [*each, query_only])

    window = None
    if sliding_window is not None:
        if not causal or prefix_length is not None:
            raise ValueError(f"{fn}: sliding_window needs causal=True and no prefix_length")
        if isinstance(sliding_window, NamedArray) or jnp.ndim(sliding_window) != 0:
            raise ValueError(f"{fn}: sliding_window must be one int (or 0-d integer array), got {sliding_window!r}")
        window = jnp.asarray(sliding_window, jnp.int32)
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"{fn}: logits_soft_cap must be positive (or None), got {logits_soft_cap!r}")
    if isinstance(causal_offset, NamedArray) or jnp.ndim(causal_offset) != 0:
        raise ValueError(
            f"{fn}: causal_offset must be one int (or 0-d integer array) for all rows, got {causal_offset!r}; "
            "for per-row offsets pass causal=False and a causal_mask(..., offset=per_row) as mask"
        )
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"{fn}: dropout_rate must be in [0, 1), got {dropout_rate}")
    if inference:
        dropout_rate = 0.0
    if dropout_rate and dropout_key is None:
        raise ValueError(
            f"{fn}: dropout_rate={dropout_rate} in training needs a PRNG key (dropout_key=...), or pass inference=True"
        )
    extras = Extras(
        mask_arr,
        bias_arr,
        q_seg,
        k_seg,
        jnp.asarray(causal_offset, jnp.int32),
        prefix,
        dropout_key if dropout_rate else None,
        window,
    )
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    cfg = FlashConfig(bool(causal), float(scale), bq, bk, KP.size, precision, float(dropout_rate), cap)
    out = cast(jax.Array, flash_attention(q_arr, k_arr, v_arr, extras, cfg))[..., : QP.size, :]  # a custom_vjp
    out_axes = (*shared, *query_only, QP, VF)
    out = NamedArray(out.reshape(tuple(a.size for a in out_axes)), out_axes)
    return restore_output(out, inputs, HeadSize)
