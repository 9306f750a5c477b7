"""Causal attention over named axes by jax's Pallas splash kernel: compiled for a TPU, interpreted elsewhere.

The kernel computes in blocks of queries and keys and skips the blocks the causal (or sliding-window) rule hides,
so no (position, key_position) scores exist in memory, forward or backward. Off a TPU it runs in Pallas's
interpreter: the same arithmetic, slowly, which is how its results are checked on a CPU.

XLA does not partition a Pallas kernel: given sharded inputs it would gather them whole. So when the current axis
mapping (nt.axis_mapping) shards the batch or the key heads over the mesh, the kernel runs inside shard_map, on
each device's share.
"""

from __future__ import annotations

import math
from typing import cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .._core import Axis, AxisSelector, NamedArray, axis_name, broadcast_to, permute
from .._sharding import current_axis_mapping, current_mesh, partition_spec
from ._attention_inputs import prepare, restore_output
from .heads import HEADS, KV_HEADS, QUERY_GROUP

SPLASH_BLOCK_SIZES = (512, 256, 128)  # the kernel's blocks must be multiples of a TPU vector's 128 lanes


def splash_block_size(length: int) -> int | None:
    """The largest block of SPLASH_BLOCK_SIZES that divides a sequence length (None: none does)."""
    return next((b for b in SPLASH_BLOCK_SIZES if length % b == 0), None)


def splash_attention(
    QPos: AxisSelector,
    KPos: AxisSelector,
    HeadSize: AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    segment_ids: NamedArray | None = None,
    logits_soft_cap: float | None = None,
    interpret: bool | None = None,
) -> NamedArray:
    """Causal softmax(query·key * scale) · value, the causal rule by index, by the Pallas splash kernel.

    The axes and grouped-query rule are `fused_attention`'s (query `heads`, key/value `heads` or `kv_heads`;
    every other key axis is a batch axis shared with the query). The query and key lengths must be equal and a
    multiple of 128. `sliding_window`: each query sees its last that many keys, itself included.
    `segment_ids` (integers over QPos and any of the batch axes; self-attention, so the keys' are the same):
    each query sees only the keys of its own segment, as packed rows need. `logits_soft_cap`: cap * tanh(s / cap)
    on the scaled scores s (Gemma 2). There is no mask argument.
    `interpret` (default: off a TPU) runs the kernel in Pallas's interpreter.
    """
    # Imported here: Pallas loads only for a program that uses the kernel.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    inputs = prepare(QPos, KPos, HeadSize, query, key, value, None, None, "splash_attention")
    q, k, v = inputs.query, inputs.key, inputs.value
    q_name, k_name, d_name = axis_name(QPos), axis_name(KPos), axis_name(HeadSize)
    length, key_length = q.axis_size(q_name), k.axis_size(k_name)
    block = splash_block_size(length)
    if length != key_length or block is None:
        raise ValueError(
            f"splash_attention needs as many queries as keys, a multiple of 128; got {length} and {key_length}"
        )
    head_names = [n for n in (KV_HEADS, HEADS) if k.has_axis(n)]  # key heads: kv_heads (GQA) or heads
    group = [QUERY_GROUP] if q.has_axis(QUERY_GROUP) else []
    batch = [a for a in k.axes if a.name not in (k_name, d_name, *head_names)]
    batch_names = [a.name for a in batch]
    flat_batch, kv_heads = math.prod(a.size for a in batch), math.prod(k.axis_size(n) for n in head_names)
    queries_per_kv = q.axis_size(QUERY_GROUP) if group else 1

    def lay_out(x: NamedArray, names: list[str], shape: tuple[int, ...]) -> jax.Array:
        return permute(x, names).array.reshape(shape)

    size = q.axis_size(d_name)
    qs = lay_out(q, [*batch_names, *head_names, *group, q_name, d_name], (flat_batch, kv_heads, -1, length, size))
    ks = lay_out(k, [*batch_names, *head_names, k_name, d_name], (flat_batch, kv_heads, length, size))
    vs = lay_out(v, [*batch_names, *head_names, k_name, d_name], (flat_batch, kv_heads, length, -1))
    scale = 1.0 / math.sqrt(size) if scale is None else scale
    ids = None
    if segment_ids is not None:
        ids = _segment_layout(segment_ids, q_name, batch, length).reshape(flat_batch, length)

    shape = (length, length)
    if sliding_window is None or sliding_window <= 0:
        rule = masks.CausalMask(shape)
    else:
        rule = masks.LocalMask(shape, window_size=(sliding_window - 1, 0), offset=0)
    blocks = kernels.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
        block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    # One kernel per (batch, kv head): the query heads that share a key head attend to it together.
    kernel = kernels.make_splash_mqa_single_device(
        masks.MultiHeadMask([rule] * queries_per_kv),
        block_sizes=blocks,
        attn_logits_soft_cap=logits_soft_cap,
        interpret=interpret,
    )
    # The flattened batch is sharded as its first axis is (a batch axis leads, as a batch mapping has it).
    batch_axis = Axis(batch_names[0], flat_batch) if batch else None
    if ids is None:
        each = jax.vmap(jax.vmap(kernel))
    else:
        # The ids are per batch row, the same for every key head.
        each = jax.vmap(jax.vmap(lambda q, k, v, i: kernel(q, k, v, kernels.SegmentIds(i, i)), (0, 0, 0, None)))
    run = _over_mesh(each, batch_axis, Axis(head_names[0], kv_heads), with_ids=ids is not None)
    out = cast(jax.Array, run(qs * jnp.asarray(scale, qs.dtype), ks, vs, *([] if ids is None else [ids])))
    out_axes = [*batch, *(q.resolve_axis(n) for n in (*head_names, *group)), q.resolve_axis(q_name)]
    out_axes.append(v.resolve_axis(d_name))
    out = out.reshape([a.size for a in out_axes]).astype(value.dtype)
    return restore_output(NamedArray(out, out_axes), inputs, HeadSize)


def _segment_layout(segment_ids: NamedArray, q_name: str, batch: list[Axis], length: int) -> jax.Array:
    """The segment ids as an int32 array (*batch, length), broadcast over the batch axes they lack."""
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"splash_attention needs integer segment ids, got dtype {segment_ids.dtype}")
    allowed = {a.name for a in batch} | {q_name}
    if not segment_ids.has_axis(q_name) or not set(segment_ids.axis_names) <= allowed:
        raise ValueError(
            f"splash_attention: segment_ids must have the axis {q_name!r} and otherwise only batch axes among "
            f"{sorted(allowed - {q_name})}; got {segment_ids.axis_names}"
        )
    ids = broadcast_to(segment_ids, [*batch, segment_ids.resolve_axis(q_name)])
    return ids.array.astype(jnp.int32).reshape(-1, length)


def _over_mesh(run, batch: Axis | None, heads: Axis, *, with_ids: bool = False):
    """run, or run inside shard_map over the mesh axes that the current mapping gives the batch and key heads
    (the leading two dimensions of q, k, v and the output; the leading one of the segment ids)."""
    mapping, mesh = current_axis_mapping(), current_mesh()
    if mapping is None or mesh is None:
        return run
    lead = partition_spec([batch or Axis("_splash_batch", 1), heads], mapping, mesh)
    if all(entry is None for entry in lead):
        return run
    q_spec, kv_spec = PartitionSpec(*lead, None, None, None), PartitionSpec(*lead, None, None)
    in_specs = (q_spec, kv_spec, kv_spec, *([PartitionSpec(lead[0], None)] if with_ids else []))
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)
