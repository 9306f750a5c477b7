"""One device's view of the layers that talk across devices, for tracing their per-device program without a mesh.

Ring attention and expert dispatch run their per-device body inside shard_map, with collectives between the
devices. A memory planner that traces one device's share of a step (every array already at its shard's size, no
mesh) needs that body as each device runs it: its blocks of keys passed around the ring, its send and receive
buffers. Inside `one_device(mapping, mesh_shape, exchange, gather)` these layers call their body directly, with
`exchange` in place of each collective that returns an array of its operand's shape (a collective permute, an
all-to-all) and `gather` in place of a tiled all-gather; the device's index on every mesh axis is 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import jax

# exchange(x) -> an array of x's shape and dtype that another device sent; gather(x, dim, factor) -> `factor`
# devices' x concatenated along dim.
Exchange = Callable[[jax.Array], jax.Array]
Gather = Callable[[jax.Array, int, int], jax.Array]


@dataclass(frozen=True)
class DeviceView:
    """The axis mapping and mesh shape a traced device belongs to, and the stand-ins for its collectives."""

    mapping: Mapping[str, str | tuple[str, ...] | None]
    mesh_shape: Mapping[str, int]
    exchange: Exchange
    gather: Gather

    def mesh_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes of more than one device that the mapping splits the logical axis `name` over."""
        value = self.mapping.get(name)
        axes = () if value is None else (value,) if isinstance(value, str) else tuple(value)
        return tuple(a for a in axes if self.mesh_shape.get(a, 1) > 1)


_VIEW: ContextVar[DeviceView | None] = ContextVar("named_tensors_device_view", default=None)


def device_view() -> DeviceView | None:
    """The view set by an enclosing `one_device`, or None when tracing or running normally."""
    return _VIEW.get()


@contextmanager
def one_device(
    mapping: Mapping[str, str | tuple[str, ...] | None],
    mesh_shape: Mapping[str, int],
    exchange: Exchange,
    gather: Gather,
) -> Iterator[DeviceView]:
    """Trace ring attention and expert dispatch as one device of a `mesh_shape` mesh under `mapping` runs them, on
    arrays already at that device's shard sizes."""
    view = DeviceView(dict(mapping), dict(mesh_shape), exchange, gather)
    token = _VIEW.set(view)
    try:
        yield view
    finally:
        _VIEW.reset(token)


__all__ = ["DeviceView", "device_view", "one_device"]
