"""Validation and grouped-query regrouping shared by plain and blockwise attention."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from .._core import Axis, AxisSelector, NamedArray, axis_name, permute, rename
from .heads import HEADS, KV_HEADS, group_query_heads, ungroup_query_heads


@dataclass(frozen=True)
class AttentionInputs:
    """Query (regrouped for GQA when needed), key, value, mask, bias and how to restore the output."""

    query: NamedArray
    key: NamedArray
    value: NamedArray
    mask: NamedArray | None
    bias: NamedArray | None
    query_names: tuple[str, ...]  # the caller's query axis order, for the output
    Heads: Axis | None  # set when the query's heads were split into (kv_heads, q_per_group)


def _need(x: NamedArray, axis: AxisSelector, role: str, fn: str) -> None:
    if not isinstance(x, NamedArray):
        raise TypeError(f"{fn}: {role} must be a NamedArray, got {type(x).__name__}")
    if not x.has_axis(axis):
        raise ValueError(f"{fn}: {role} needs axis {axis_name(axis)!r}, but has axes {x.axis_names}")
    x.axis_index(axis)


def prepare(
    QPos: AxisSelector,
    KPos: AxisSelector,
    HeadSize: AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: NamedArray | None,
    bias: NamedArray | None,
    fn: str,
) -> AttentionInputs:
    """Check the inputs and split the query's heads when keys have `kv_heads` (grouped-query attention)."""
    q_name, k_name, d_name = axis_name(QPos), axis_name(KPos), axis_name(HeadSize)
    if q_name == k_name:
        raise ValueError(
            f"{fn}: query and key position axes must have different names, both are {q_name!r}; rename "
            "the key/value position axis (e.g. k.rename({'position': 'key_position'}))"
        )
    _need(query, QPos, "query", fn)
    _need(query, HeadSize, "query", fn)
    _need(key, KPos, "key", fn)
    _need(key, HeadSize, "key", fn)
    _need(value, KPos, "value", fn)
    if query.has_axis(k_name) or key.has_axis(q_name) or value.has_axis(q_name):
        raise ValueError(
            f"{fn}: the query must not have the key position axis {k_name!r}, nor key/value the query "
            f"position axis {q_name!r} (query axes {query.axis_names}, key axes {key.axis_names})"
        )
    if query.dtype != key.dtype:
        raise TypeError(f"{fn}: query dtype {query.dtype} differs from key dtype {key.dtype}; cast first")
    if key.axis_size(KPos) != value.axis_size(KPos):
        raise ValueError(f"{fn}: key and value have different {k_name!r} sizes")
    for m, role in ((mask, "mask"), (bias, "bias")):
        if m is not None and not isinstance(m, NamedArray):
            raise TypeError(f"{fn}: {role} must be a NamedArray (or None), got {type(m).__name__}")
    if mask is not None and mask.dtype != jnp.bool_:
        raise TypeError(f"{fn}: mask must be boolean (True = may attend), got dtype {mask.dtype}")

    query_names = query.axis_names
    Heads = None
    if key.has_axis(KV_HEADS) and not key.has_axis(HEADS) and query.has_axis(HEADS):
        if not value.has_axis(KV_HEADS):
            raise ValueError(f"{fn}: key has {KV_HEADS!r} but value does not (value axes {value.axis_names})")
        KVHeads = key.resolve_axis(KV_HEADS)
        if KVHeads.size == query.axis_size(HEADS) and value.axis_size(KV_HEADS) == KVHeads.size:
            # As many key/value heads as query heads: plain multi-head attention. Renaming avoids a size-1
            # q_per_group axis (and the transposes it costs); the output axes are the query's either way.
            to_heads: dict[AxisSelector, AxisSelector] = {KV_HEADS: HEADS}
            key, value = rename(key, to_heads), rename(value, to_heads)
            mask = _kv_to_heads(mask)
            bias = _kv_to_heads(bias)
        else:
            Heads = query.resolve_axis(HEADS)
            query = group_query_heads(query, KVHeads)
            mask = group_query_heads(mask, KVHeads) if mask is not None and mask.has_axis(HEADS) else mask
            bias = group_query_heads(bias, KVHeads) if bias is not None and bias.has_axis(HEADS) else bias

    shared = [a for a in key.axes if a.name not in (k_name, d_name)]
    for a in shared:
        if not query.has_axis(a.name):
            raise ValueError(
                f"{fn}: key axis {a.name!r} is not in the query (query axes {query.axis_names}); for "
                f"grouped-query attention name the query heads {HEADS!r} and the key/value heads {KV_HEADS!r}"
            )
        query.axis_index(a)
    score_names = {*query.axis_names, k_name} - {d_name}
    for m, role in ((mask, "mask"), (bias, "bias")):
        if m is not None:
            extra = [n for n in m.axis_names if n not in score_names]
            if extra:
                raise ValueError(
                    f"{fn}: {role} has axes {extra} that the attention scores do not have "
                    f"(scores have {sorted(score_names)})"
                )
    return AttentionInputs(query, key, value, mask, bias, query_names, Heads)


def _kv_to_heads(x: NamedArray | None) -> NamedArray | None:
    """A mask or bias given over kv_heads, renamed to heads (plain multi-head attention)."""
    if x is not None and x.has_axis(KV_HEADS) and not x.has_axis(HEADS):
        return rename(x, {KV_HEADS: HEADS})
    return x


def restore_output(out: NamedArray, inputs: AttentionInputs, HeadSize: AxisSelector) -> NamedArray:
    """Merge grouped heads back and put the output axes in the caller's query order."""
    if inputs.Heads is not None:
        out = ungroup_query_heads(out, inputs.Heads)
    d_name = axis_name(HeadSize)
    feature = [n for n in out.axis_names if n not in inputs.query_names]
    order = [n for n in inputs.query_names if n != d_name or not feature]
    # The value's feature axis takes the place of the query's head size axis.
    if feature:
        i = inputs.query_names.index(d_name)
        order = [*order[:i], *feature, *order[i:]]
    return permute(out, order)
