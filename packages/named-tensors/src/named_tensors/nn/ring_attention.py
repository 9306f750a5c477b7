"""Ring attention: self-attention over a position axis split across a mesh axis, keys and values passed around it."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .. import _ops as ops
from .._core import Axis, AxisSelector, NamedArray, axis_name, permute
from .._sharding import _as_mesh_axes, axis_mapping, current_axis_mapping, current_mesh, partition_spec
from ._attention_inputs import prepare, restore_output
from .attention import _matmul
from .device_view import device_view
from .softcap import soft_cap


def ring_mesh_axis(Pos: AxisSelector) -> str | None:
    """The mesh axis that the current axis mapping splits `Pos` over, when it has more than one device; else None."""
    view = device_view()
    name = axis_name(Pos)
    if view is not None:
        split = list(view.mesh_axes(name))
    else:
        mapping, mesh = current_axis_mapping(), current_mesh()
        if mapping is None or mesh is None:
            return None
        split = [m for m in _as_mesh_axes(mapping.get(name), name) if mesh.shape[m] > 1]
    if len(split) > 1:
        raise ValueError(
            f"ring attention passes keys around one mesh axis, but the axis mapping splits {name!r} over {split}; "
            "map it to one mesh axis"
        )
    return split[0] if split else None


def ring_attention(
    QPos: AxisSelector,
    KPos: AxisSelector,
    HeadSize: AxisSelector,
    query: NamedArray,
    key: NamedArray,
    value: NamedArray,
    *,
    query_positions: NamedArray,
    key_positions: NamedArray,
    query_segment_ids: NamedArray | None = None,
    key_segment_ids: NamedArray | None = None,
    causal: bool = True,
    sliding_window: int | jax.Array | None = None,
    scale: float | None = None,
    logits_soft_cap: float | None = None,
    precision: jax.lax.PrecisionLike = None,
    mesh_axis: str | None = None,
) -> NamedArray:
    """Self-attention whose positions are split over `mesh_axis` (default: the one the current mapping gives QPos).

    Each device keeps its queries; the key/value blocks travel once around the ring (jax.lax.ppermute) and are
    combined with an online softmax in float32, so no device ever holds all keys; the backward recomputes each
    block's scores, so a device holds one block of scores, (positions / devices)² per head, at a time. Which key
    a query sees is decided by the positions that travel with the blocks, never by index: query q sees key k when
    k's position <= q's (`causal`), k's position > q's - `sliding_window` (a window <= 0 or None: no limit) and,
    with segment ids, both have the same id (packed sequences). So any order of the positions along the axis gives
    the same result, and a causally load-balanced layout (device i holding chunks i and 2C-1-i) is as right as the
    natural one.
    A block that no query of a device sees is skipped. Axes other than positions and HeadSize are matched by
    name as in dot_product_attention (grouped-query heads included); the value's head axis must be HeadSize.
    The current axis mapping and mesh lay out the other axes (batch, heads).
    """
    fn = "ring_attention"
    if device_view() is not None:
        return _one_device_ring(
            QPos, KPos, HeadSize, query, key, value, query_positions, key_positions, query_segment_ids,
            key_segment_ids, causal, sliding_window, scale, logits_soft_cap, precision, mesh_axis,
        )  # fmt: skip
    mapping, mesh = current_axis_mapping(), current_mesh()
    if mapping is None or mesh is None:
        raise ValueError(f"{fn} needs a mesh and an axis mapping: call it inside nt.axis_mapping(mapping, mesh=...)")
    ring = mesh_axis or ring_mesh_axis(QPos)
    if ring is None:
        raise ValueError(f"{fn}: the axis mapping does not split {axis_name(QPos)!r} over a mesh axis; give mesh_axis")
    q_name, k_name, d_name = axis_name(QPos), axis_name(KPos), axis_name(HeadSize)
    prepare(QPos, KPos, HeadSize, query, key, value, None, None, fn)  # checks the axes before anything is traced
    if not value.has_axis(d_name):
        raise ValueError(f"{fn}: the value needs the head size axis {d_name!r}, but has axes {value.axis_names}")
    for ids, role in ((query_positions, "query_positions"), (key_positions, "key_positions")):
        if not isinstance(ids, NamedArray) or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{fn}: {role} must be an integer NamedArray, got {ids!r}")
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError(f"{fn}: give both query_segment_ids and key_segment_ids, or neither")
    if scale is None:
        scale = 1.0 / math.sqrt(query.axis_size(HeadSize))
    size = mesh.shape[ring]
    # Both position axes live on the ring's mesh axis: the keys of a device are those of its own queries.
    local_mapping = {**mapping, q_name: ring, k_name: ring}
    named = [query, key, value, query_positions, key_positions]
    if query_segment_ids is not None and key_segment_ids is not None:
        named += [query_segment_ids, key_segment_ids]
    for x in named:
        for position in (q_name, k_name):
            if x.has_axis(position) and x.axis_size(position) % size:
                raise ValueError(
                    f"{fn}: axis {position!r} has {x.axis_size(position)} positions, which the {size} devices of "
                    f"mesh axis {ring!r} do not divide"
                )
    specs = [partition_spec(x.axes, local_mapping, mesh) for x in named]
    local_axes = [_local_axes(x.axes, spec, mesh.shape) for x, spec in zip(named, specs, strict=True)]
    out_axes = tuple(a if a.name != d_name else value.resolve_axis(d_name) for a in query.axes)
    out_spec = partition_spec(out_axes, local_mapping, mesh)
    window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)

    perm = [(j, (j + 1) % size) for j in range(size)]

    def local(window: jax.Array, *arrays: jax.Array) -> jax.Array:
        parts = [NamedArray(a, axes) for a, axes in zip(arrays, local_axes, strict=True)]
        q, k, v, q_pos, k_pos = parts[:5]
        q_seg, k_seg = (parts[5], parts[6]) if len(parts) > 5 else (None, None)
        with axis_mapping(None):  # inside shard_map each array is one device's block: no constraints by name
            out = _ring_blocks(
                QPos=q_name, KPos=k_name, HeadSize=d_name, q=q, k=k, v=v, q_pos=q_pos, k_pos=k_pos, q_seg=q_seg,
                k_seg=k_seg, causal=causal, window=window, use_window=sliding_window is not None, scale=scale,
                logits_soft_cap=logits_soft_cap, precision=precision, size=size,
                shift=functools.partial(jax.lax.ppermute, axis_name=ring, perm=perm),
            )  # fmt: skip
        return permute(out, tuple(a.name for a in out_axes)).array

    # check_vma=False: a pipeline calls this inside jax.vmap(spmd_axis_name="stage"). Batching the body, jax 0.10
    # types the inputs of its inner jaxprs (each rematerialised block, the cond that skips blocks) as invariant over
    # "stage" although their operands vary over it, and records a pvary over "stage" in them; with the varying-axes
    # checks on, the cond's branches then disagree and the backward's re-evaluation of a block rejects that pvary.
    # Unchecked, the compiled step has the same collectives (every input is split or replicated as its spec says).
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(), *specs),
        out_specs=out_spec,
        axis_names=set(mesh.axis_names),
        check_vma=False,
    )
    return NamedArray(mapped(window, *(x.array for x in named)), out_axes)


def _one_device_ring(
    QPos, KPos, HeadSize, query, key, value, q_pos, k_pos, q_seg, k_seg, causal, sliding_window, scale,
    logits_soft_cap, precision, mesh_axis,
) -> NamedArray:  # fmt: skip
    """One device's ring attention under nn.one_device: the arrays are its shards, the view's exchange the permute."""
    view = device_view()
    assert view is not None
    ring = mesh_axis or ring_mesh_axis(QPos)
    if ring is None:
        raise ValueError(f"ring_attention: the axis mapping does not split {axis_name(QPos)!r}; give mesh_axis")
    if scale is None:
        scale = 1.0 / math.sqrt(query.axis_size(HeadSize))
    out = _ring_blocks(
        QPos=axis_name(QPos), KPos=axis_name(KPos), HeadSize=axis_name(HeadSize), q=query, k=key, v=value,
        q_pos=q_pos, k_pos=k_pos, q_seg=q_seg, k_seg=k_seg, causal=causal,
        window=jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32),
        use_window=sliding_window is not None, scale=scale, logits_soft_cap=logits_soft_cap, precision=precision,
        size=view.mesh_shape[ring], shift=lambda x: jax.tree.map(view.exchange, x),
    )  # fmt: skip
    return permute(out, query.axis_names)


def _local_axes(axes: Sequence[Axis], spec: PartitionSpec, shape: dict[str, int]) -> tuple[Axis, ...]:
    """One device's block of `axes` under `spec`: each sharded axis divided by its mesh axes' sizes."""
    out = []
    for axis, entry in zip(axes, (*spec, *([None] * (len(axes) - len(spec)))), strict=True):
        parts = math.prod(shape[m] for m in _as_mesh_axes(entry, axis.name))
        out.append(axis.resize(axis.size // parts))
    return tuple(out)


def _ring_blocks(
    *,
    QPos: str,
    KPos: str,
    HeadSize: str,
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    q_pos: NamedArray,
    k_pos: NamedArray,
    q_seg: NamedArray | None,
    k_seg: NamedArray | None,
    causal: bool,
    window: jax.Array,
    use_window: bool,
    scale: float,
    logits_soft_cap: float | None,
    precision: jax.lax.PrecisionLike,
    size: int,
    shift: Callable[[NamedArray], NamedArray],
) -> NamedArray:
    """One device's attention: its queries against each of the `size` key/value blocks as they come round."""
    inputs = prepare(QPos, KPos, HeadSize, q, k, v, None, None, "ring_attention")
    query = inputs.query
    q_pos = q_pos.astype(jnp.int32)

    def visible_of(k_pos: NamedArray, k_seg: NamedArray | None) -> NamedArray | None:
        mask = None
        if causal:
            mask = k_pos <= q_pos
        if use_window:
            in_window = (k_pos > q_pos - window) | (window <= 0)
            mask = in_window if mask is None else mask & in_window
        if q_seg is not None and k_seg is not None:
            same = q_seg == k_seg
            mask = same if mask is None else mask & same
        return mask

    # Rematerialised: the backward recomputes a block's scores from the block and the running values, so a
    # device keeps one block of scores at a time, not its queries' scores against every key (flash attention's
    # trade of a second score pass for memory).
    @jax.checkpoint
    def block(carry, key, value, k_pos, k_seg):
        """The running (max, sum, weighted values) updated with one key/value block."""
        top, total, acc = carry
        scores = _matmul(query, key, HeadSize, precision, jnp.float32)
        scores = soft_cap(scores * scale, logits_soft_cap)
        visible = visible_of(k_pos, k_seg)
        lowest = jnp.finfo(jnp.float32).min
        if visible is not None:
            visible = visible.broadcast_to(scores.axes)
            scores = ops.where(visible, scores, lowest)
        # The running max only keeps the exponentials in range: the result does not depend on it.
        new_top = ops.stop_gradient(ops.maximum(top, ops.max(scores, KPos)))
        weights = ops.exp(scores - new_top)
        if visible is not None:
            weights = ops.where(visible, weights, 0.0)
        correction = ops.exp(top - new_top)
        total = total * correction + ops.sum(weights, KPos)
        values = _matmul(weights.astype(value.dtype), value, KPos, precision, jnp.float32)
        acc = acc * correction + values
        return new_top, total, permute(acc, carry[2].axis_names)

    k, v = inputs.key, inputs.value  # with as many kv heads as heads, renamed to heads
    Rows = [a for a in _matmul(query, k, HeadSize, precision, jnp.float32).axes if a.name != KPos]
    acc_axes = [*Rows, v.resolve_axis(HeadSize)]
    carry = (
        NamedArray(jnp.full([a.size for a in Rows], jnp.finfo(jnp.float32).min, jnp.float32), Rows),
        NamedArray(jnp.zeros([a.size for a in Rows], jnp.float32), Rows),
        NamedArray(jnp.zeros([a.size for a in acc_axes], jnp.float32), acc_axes),
    )
    key, value, key_pos, key_seg = k, v, k_pos, k_seg
    for step in range(size):
        visible = visible_of(key_pos, key_seg)
        if visible is None or step == 0:
            # The device's own block (its diagonal) is always computed: each query sees at least its own key.
            carry = block(carry, key, value, key_pos, key_seg)
        else:
            # A block that none of this device's queries sees (later positions, another window) costs nothing.
            carry = jax.lax.cond(
                ops.any(visible).array,
                lambda c, *xs: block(c, *xs),
                lambda c, *xs: c,
                carry,
                key,
                value,
                key_pos,
                key_seg,
            )
        if step < size - 1:
            key, value, key_pos = shift(key), shift(value), shift(key_pos)
            key_seg = None if key_seg is None else shift(key_seg)
    _, total, acc = carry
    # A query that sees no key at all gets zeros, as in dot_product_attention.
    out = acc / ops.where(total > 0, total, 1.0)
    return restore_output(out.astype(q.dtype), inputs, HeadSize)


__all__ = ["ring_attention", "ring_mesh_axis"]
