"""Grouped-query attention by name: query `heads` split into (`kv_heads`, `q_per_group`) and back.

Query head h belongs to key/value head h // q_per_group (kv-major), the order Hugging Face's `repeat_kv`
uses, so HF weights need no permutation. Splitting the query's heads instead of repeating K and V means
each key/value head is stored and read once.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._core import Axis, AxisSelector, NamedArray, axis_name, permute

HEADS = "heads"
KV_HEADS = "kv_heads"
QUERY_GROUP = "q_per_group"


def group_query_heads(x: NamedArray, KVHeads: Axis, *, Heads: AxisSelector = HEADS) -> NamedArray:
    """Replace x's Heads axis by (KVHeads, q_per_group), placed last; Heads must be a multiple of KVHeads."""
    heads = x.resolve_axis(Heads)
    if not isinstance(KVHeads, Axis):
        raise TypeError(f"group_query_heads needs the KVHeads Axis with its size, got {KVHeads!r}")
    if KVHeads.size == 0 or heads.size % KVHeads.size != 0:
        raise ValueError(
            f"Grouped-query attention needs {heads.name}={heads.size} to be a multiple of {KVHeads.name}={KVHeads.size}"
        )
    Group = Axis(QUERY_GROUP, heads.size // KVHeads.size)
    moved = permute(x, (..., heads.name))
    rest = moved.axes[:-1]
    return NamedArray(
        jnp.reshape(moved.array, (*(a.size for a in rest), KVHeads.size, Group.size)), (*rest, KVHeads, Group)
    )


def ungroup_query_heads(x: NamedArray, Heads: Axis, *, KVHeads: AxisSelector = KV_HEADS) -> NamedArray:
    """Merge x's (KVHeads, q_per_group) axes back into Heads, placed last."""
    kv, group = x.resolve_axis(KVHeads), x.resolve_axis(QUERY_GROUP)
    if kv.size * group.size != Heads.size:
        raise ValueError(f"Cannot merge {kv} x {group} into {Heads}: sizes do not multiply up")
    moved = permute(x, (..., axis_name(kv), QUERY_GROUP))
    rest = moved.axes[:-2]
    return NamedArray(jnp.reshape(moved.array, (*(a.size for a in rest), Heads.size)), (*rest, Heads))
