"""Fetching one parameter (or one layer of a stacked one) to the writing process's host, shard by shard.

Nothing is gathered whole on a device or copied twice on the host: the writer's addressable shards are copied
straight into the place of the output tensor that they fill. When process 0 cannot address a whole copy (the
parameter is spread over several hosts), one collective per tensor gives every process a complete copy spread
over its own devices (sharded along the mesh axes that stay within a host), and process 0 copies that.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Index = tuple[tuple[int, int], ...]


def fill(target: np.ndarray | None, array: object, select: Mapping[int, int]) -> None:
    """Copy `array`, at index `select[k]` of each axis k in `select` (a layer, an expert), into `target` on the
    writer; every process must call this.

    `target` is None on the processes that do not write; they only take part in the collective, when one is
    needed. `target` has the array's shape without the selected axes, and may be a strided view.
    """
    if not isinstance(array, jax.Array):
        if target is not None:
            host = np.asarray(array)
            target[...] = host[_where(select, host.ndim)]
        return
    if not array.is_fully_addressable and not _writer_holds_a_copy(array.sharding, array.shape):
        array = _per_process_copy(array, select)
        select = {}
    if target is None:
        return
    seen: set[Index] = set()
    for shard in array.addressable_shards:
        index = bounds(shard.index, array.shape)
        if index in seen:
            continue  # a replica of a shard already copied
        seen.add(index)
        if not all(index[k][0] <= i < index[k][1] for k, i in select.items()):
            continue
        rest = tuple(r for k, r in enumerate(index) if k not in select)
        target[_slices(rest)] = _host(shard.data, {k: i - index[k][0] for k, i in select.items()})


def bounds(index: Sequence[slice], shape: Sequence[int]) -> Index:
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def _slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


def _where(select: Mapping[int, int], ndim: int) -> tuple[int | slice, ...]:
    return tuple(select.get(k, slice(None)) for k in range(ndim))


def _host(data: jax.Array, select: Mapping[int, int]) -> np.ndarray:
    """A shard's data (or one index along some of its axes) on the host, copying no more than that."""
    device = next(iter(data.devices()))
    where = _where(select, data.ndim) if select else None
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


def _per_process_copy(array: jax.Array, select: Mapping[int, int]) -> jax.Array:
    """The array (or its index `select[k]` along each axis k) laid out so that each process's devices hold one
    complete copy."""
    axes = tuple(sorted(select))
    shape = tuple(n for k, n in enumerate(array.shape) if k not in select)
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        out = NamedSharding(Mesh(np.array(list(sharding._device_assignment)), ("all",)), PartitionSpec())
    else:
        # An array's NamedSharding has a concrete mesh (an abstract one only appears while tracing).
        out = NamedSharding(sharding.mesh, _process_complete_spec(sharding.mesh, shape))  # pyright: ignore[reportArgumentType]
    copy = _copier(out, axes)
    replicated = NamedSharding(out.mesh, PartitionSpec())
    indices = [jax.make_array_from_callback((), replicated, lambda _, i=select[k]: np.int32(i)) for k in axes]
    return copy(array, *indices)


@functools.lru_cache(maxsize=512)
def _copier(out: NamedSharding, axes: tuple[int, ...]):
    def take(a: jax.Array, *indices: jax.Array) -> jax.Array:
        # From the last axis back, so that the earlier axes keep their numbers.
        for k, i in sorted(zip(axes, indices, strict=True), key=lambda pair: pair[0], reverse=True):
            a = jax.lax.dynamic_index_in_dim(a, i, k, keepdims=False)
        return a

    return jax.jit(take, out_shardings=out)


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
