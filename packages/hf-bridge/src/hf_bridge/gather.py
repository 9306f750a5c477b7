"""Fetching one parameter (or one layer of a stacked one) to the writing process's host, shard by shard.

Nothing is gathered whole on a device or copied twice on the host: the writer's addressable shards are copied
straight into the place of the output tensor that they fill. When process 0 cannot address a whole copy (the
parameter is spread over several hosts), one collective per tensor gives every process a complete copy spread
over its own devices (sharded along the mesh axes that stay within a host), and process 0 copies that.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Index = tuple[tuple[int, int], ...]


def fill(target: np.ndarray | None, array: object, layer_axis: int | None, layer: int | None) -> None:
    """Copy `array` (or its `layer` along `layer_axis`) into `target` on the writer; every process must call this.

    `target` is None on the processes that do not write; they only take part in the collective, when one is
    needed. `target` has the array's shape without the layer axis, and may be a strided view.
    """
    if not isinstance(array, jax.Array):
        if target is not None:
            target[...] = np.asarray(array) if layer_axis is None else np.take(np.asarray(array), layer, layer_axis)
        return
    if not array.is_fully_addressable and not _writer_holds_a_copy(array.sharding, array.shape):
        array = _per_process_copy(array, layer_axis, layer)
        layer_axis = layer = None
    if target is None:
        return
    seen: set[Index] = set()
    for shard in array.addressable_shards:
        index = bounds(shard.index, array.shape)
        if index in seen:
            continue  # a replica of a shard already copied
        seen.add(index)
        if layer_axis is None:
            target[_slices(index)] = _host(shard.data, None)
            continue
        start, stop = index[layer_axis]
        if start <= layer < stop:
            rest = index[:layer_axis] + index[layer_axis + 1 :]
            target[_slices(rest)] = _host(shard.data, (layer_axis, layer - start))


def bounds(index: Sequence[slice], shape: Sequence[int]) -> Index:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def _slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


def _host(data: jax.Array, select: tuple[int, int] | None) -> np.ndarray:
    """A shard's data (or one index along one axis of it) on the host, copying no more than that."""
    device = next(iter(data.devices()))
    where = None if select is None else (slice(None),) * select[0] + (select[1],)
    if device.platform == "cpu":
        # A CPU device's buffer is host memory: numpy views it without a copy.
        view = np.asarray(data)
        return view if where is None else view[where]
    # Elsewhere, copy the part needed to the host from a temporary, so no host copy stays cached on the shard.
    return np.asarray(data[where] if where is not None else data.copy())


@functools.lru_cache(maxsize=512)
def _writer_holds_a_copy(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """Whether process 0's devices hold every element of an array of this sharding (the same on every process)."""
    held: set[Index] = set()
    for device, index in sharding.devices_indices_map(shape).items():
        if device.process_index == 0:
            held.add(bounds(index, shape))
    return sum(math.prod(b - a for a, b in box) for box in held) == math.prod(shape)


def _per_process_copy(array: jax.Array, layer_axis: int | None, layer: int | None) -> jax.Array:
    """The array (or one layer of it) laid out so that each process's devices hold one complete copy."""
    shape = array.shape if layer_axis is None else array.shape[:layer_axis] + array.shape[layer_axis + 1 :]
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        out = NamedSharding(Mesh(np.array(list(sharding._device_assignment)), ("all",)), PartitionSpec())
    else:
        out = NamedSharding(sharding.mesh, _process_complete_spec(sharding.mesh, shape))
    copy = _copier(out, layer_axis)
    if layer_axis is None:
        return copy(array)
    index = jax.make_array_from_callback((), NamedSharding(out.mesh, PartitionSpec()), lambda _: np.int32(layer))
    return copy(array, index)


@functools.lru_cache(maxsize=512)
def _copier(out: NamedSharding, layer_axis: int | None):
    if layer_axis is None:
        return jax.jit(lambda a: a, out_shardings=out)
    return jax.jit(lambda a, i: jax.lax.dynamic_index_in_dim(a, i, layer_axis, keepdims=False), out_shardings=out)


def _process_complete_spec(mesh: Mesh, shape: tuple[int, ...]) -> PartitionSpec:
    """A spec that shards one dimension over the mesh axes that never cross a host, replicated over the rest.

    Every process then holds one whole copy over its devices (not one per device, as full replication would).
    """
    process = np.vectorize(lambda d: d.process_index)(mesh.devices)
    local = [
        name
        for k, name in enumerate(mesh.axis_names)
        if mesh.devices.shape[k] > 1 and bool(np.all(process == np.take(process, [0], axis=k)))
    ]
    for axes in (tuple(local), *((name,) for name in local)):
        size = math.prod(mesh.shape[a] for a in axes)
        for dim, n in enumerate(shape):
            if axes and n % size == 0:
                return PartitionSpec(*([None] * dim), axes)
    return PartitionSpec()
