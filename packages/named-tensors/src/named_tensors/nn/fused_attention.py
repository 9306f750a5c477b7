"""Scaled dot-product attention over named axes through `jax.nn.dot_product_attention`: XLA's, or cuDNN's fused
kernel on NVIDIA GPUs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .._core import AxisSelector, NamedArray, axis_name, permute
from ._attention_inputs import prepare, restore_output
from .heads import HEADS, KV_HEADS, QUERY_GROUP

IMPLEMENTATIONS = ("xla", "cudnn")


def fused_attention(
    QPos: AxisSelector,
    KPos: AxisSelector,
    HeadSize: AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    mask: NamedArray | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    sliding_window: int | None = None,
    implementation: str | None = None,
) -> NamedArray:
    """softmax(query·key * scale, masked, over KPos) · value, computed by jax.nn.dot_product_attention.

    The same axes and grouped-query rule as `dot_product_attention` (query `heads`, key/value `heads` or
    `kv_heads`; every other key axis is a batch axis shared with the query). `causal` and `sliding_window`
    (each query sees its last `sliding_window` keys, itself included) go by index along the two position axes,
    as a kernel needs them; `mask` (True = may attend, over any of the score axes) is applied as well.
    `implementation`: "xla", "cudnn" (NVIDIA GPUs, bfloat16 or float16) or None (jax's choice). Unlike
    `dot_product_attention`, a query row with every key masked is not zeroed; causal attention has none.
    """
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"fused_attention: implementation must be one of {IMPLEMENTATIONS} or None")
    inputs = prepare(QPos, KPos, HeadSize, query, key, value, mask, None, "fused_attention")
    q, k, v = inputs.query, inputs.key, inputs.value
    q_name, k_name, d_name = axis_name(QPos), axis_name(KPos), axis_name(HeadSize)
    head_names = [n for n in (KV_HEADS, HEADS) if k.has_axis(n)]  # key heads: kv_heads (GQA) or heads
    query_heads = [*head_names, QUERY_GROUP] if q.has_axis(QUERY_GROUP) else head_names
    batch = [a for a in k.axes if a.name not in (k_name, d_name, *head_names)]
    batch_names = [a.name for a in batch]
    flat_batch = math.prod(a.size for a in batch)

    def lay_out(x: NamedArray, pos: str, heads: list[str]) -> jax.Array:
        """(batch, position, heads, head size) as one array, batch and heads axes flattened."""
        arranged = permute(x, (*batch_names, pos, *heads, x.resolve_axis(d_name).name)).array
        return arranged.reshape(flat_batch, arranged.shape[len(batch)], -1, arranged.shape[-1])

    scores_order = [*batch_names, *query_heads, q_name, k_name]
    dense_mask = None
    if inputs.mask is not None:
        m = inputs.mask
        present = [n for n in scores_order if m.has_axis(n)]
        # Absent axes become size-1 dimensions, which jax broadcasts: (batch, heads, query, key) in the end.
        full = permute(m, present).array.reshape([m.axis_size(n) if n in present else 1 for n in scores_order])
        n_batch, n_heads = len(batch_names), len(query_heads)
        # A group (batch axes, head axes) that the mask has only in part is spread over the whole group first.
        target = list(full.shape)
        for names, start in ((batch_names, 0), (query_heads, n_batch)):
            if any(n in present for n in names):
                target[start : start + len(names)] = [q.axis_size(n) for n in names]
        full = jnp.broadcast_to(full, target)
        dense_mask = full.reshape(
            math.prod(full.shape[:n_batch]), math.prod(full.shape[n_batch : n_batch + n_heads]), *full.shape[-2:]
        )
        if implementation == "cudnn":
            # jax hands cuDNN the mask as a bias, which must span every query and key (jax-ml/jax#28974);
            # batch and heads may stay 1. XLA broadcasts by itself, so only this branch pays for the copy.
            dense_mask = jnp.broadcast_to(dense_mask, (*dense_mask.shape[:2], q.axis_size(q_name), k.axis_size(k_name)))
    window = None if sliding_window is None or sliding_window <= 0 else (sliding_window - 1, 0)
    out = jax.nn.dot_product_attention(
        lay_out(q, q_name, query_heads),
        lay_out(k, k_name, head_names),
        lay_out(v, k_name, head_names),
        mask=dense_mask,
        scale=scale,
        is_causal=causal,
        local_window_size=window,
        implementation=implementation,
    )
    out_axes = [*batch, q.resolve_axis(q_name), *(q.resolve_axis(n) for n in query_heads), v.resolve_axis(d_name)]
    out = out.reshape([a.size for a in out_axes]).astype(value.dtype)
    return restore_output(NamedArray(out, out_axes), inputs, HeadSize)
