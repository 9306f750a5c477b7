"""Reading one parameter of ours from a checkpoint straight into its sharded layout.

Each process reads only what its own devices hold: for every distinct shard on its devices, the rows of each
checkpoint tensor that cover the shard (one ranged read per tensor for all of them), cut out in our axis order
into a host buffer of the shard's size, which then goes to its devices. No process holds the whole model,
nor, when the parameter is sharded across processes, the whole parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from named_tensors import NamedArray

from .gather import Index, bounds
from .layout import HfTensor, PartReader, check_hf_shape
from .params import LAYERS
from .reader import CheckpointReader

# Remote reads of several tensors are issued together up to this many bytes (a larger tensor goes alone).
BATCH_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Member:
    """One parameter of ours filled from a checkpoint tensor: the part it is, its axes, sharding and dtype."""

    index: int
    leaf: NamedArray
    sharding: jax.sharding.Sharding
    dtype: np.dtype


def read_parameters(
    reader: CheckpointReader,
    key_of: Callable[[int | None], str],
    spec: HfTensor,
    part_sizes: list[dict[str, int]],
    members: list[Member],
    layers: list[int] | None,
    truncatable: frozenset[str],
) -> list[jax.Array]:
    """The parameters that one checkpoint tensor holds (several for a fused one), as sharded jax.Arrays.

    For stacked parameters, `layers` lists the layer held at each index of their `layers` axis; otherwise it
    is None and `key_of(None)` is the one checkpoint key to read. Each tensor (each layer's) is read once,
    as the rows that cover every shard of every member on this process's devices.
    """
    plans = [_Plan(m, layers is not None) for m in members]
    reads = []  # per layer: (position, key, first row, last row, the shards it fills)
    for position, layer in enumerate(layers if layers is not None else [None]):
        key = key_of(layer)
        entry = reader.entry(key)
        check_hf_shape(spec, entry.shape, part_sizes, key, truncatable)
        wanted = []
        for plan in plans:
            part = PartReader(spec, plan.member.index, tuple(part_sizes), entry.shape)
            wanted += [(plan, part, box) for box in plan.boxes_at(position)]
        if wanted:
            spans = [part.rows(plan.named(box)) for plan, part, box in wanted]
            first, last = min(s for s, _ in spans), max(e for _, e in spans)
            reads.append((position, key, first, last, wanted, (last - first) * entry.row_bytes))
    # One ranged read per tensor for all of this process's shards. At a URL, several tensors at once, up to a
    # byte budget, so that their requests' latencies overlap; locally one at a time, which holds less.
    for batch in _batches(reads, BATCH_BYTES if reader.location.remote else 0):
        rows_of = reader.rows_of([(key, first, last) for _, key, first, last, _, _ in batch])
        for (position, _, first, _, wanted, _), rows in zip(batch, rows_of, strict=True):
            for plan, part, box in wanted:
                plan.put(box, position, part.cut(rows, first, plan.named(box), plan.our_names))
        del rows_of
    return [plan.place() for plan in plans]


def _batches(reads: list, budget: int) -> list[list]:
    batches: list[list] = [[]]
    used = 0
    for read in reads:
        if batches[-1] and used + read[-1] > budget:
            batches.append([])
            used = 0
        batches[-1].append(read)
        used += read[-1]
    return [b for b in batches if b]


class _Plan:
    """The host buffers of one parameter's distinct shards on this process, filled as tensors are read."""

    def __init__(self, member: Member, stacked: bool) -> None:
        self.member = member
        self.names = [a.name for a in member.leaf.axes]
        self.shape = tuple(a.size for a in member.leaf.axes)
        self.layer_axis = self.names.index(LAYERS) if stacked else None
        self.our_names = [n for k, n in enumerate(self.names) if k != self.layer_axis]
        self.devices = member.sharding.addressable_devices_indices_map(self.shape)
        self.box_of = {device: bounds(idx, self.shape) for device, idx in self.devices.items()}
        self.buffers = {box: np.empty(tuple(b - a for a, b in box), member.dtype) for box in self.box_of.values()}

    def boxes_at(self, position: int) -> list[Index]:
        """The shards that hold index `position` of the layers axis (every shard when not stacked)."""
        k = self.layer_axis
        return [b for b in self.buffers if k is None or b[k][0] <= position < b[k][1]]

    def named(self, box: Index) -> dict[str, tuple[int, int]]:
        return {n: r for k, (n, r) in enumerate(zip(self.names, box, strict=True)) if k != self.layer_axis}

    def put(self, box: Index, position: int, block: np.ndarray) -> None:
        k = self.layer_axis
        if k is None:
            self.buffers[box][...] = block
        else:
            self.buffers[box][(slice(None),) * k + (position - box[k][0],)] = block

    def place(self) -> jax.Array:
        arrays = [jax.device_put(self.buffers[self.box_of[d]], d) for d in self.devices]
        # Transfers are asynchronous and keep their host buffer alive: wait, or every parameter's buffers would
        # pile up in host memory.
        jax.block_until_ready(arrays)
        self.buffers.clear()
        return jax.make_array_from_single_device_arrays(self.shape, self.member.sharding, arrays)
