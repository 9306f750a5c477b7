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

from lm_models import HfTensor
from named_tensors import NamedArray

from .gather import Index, bounds
from .layout import PartReader, check_hf_shape
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
    key_of: Callable[[int | None, int | None], str],
    spec: HfTensor,
    part_sizes: list[dict[str, int]],
    members: list[Member],
    layers: list[int] | None,
    truncatable: frozenset[str],
) -> list[jax.Array]:
    """The parameters that one checkpoint tensor holds (several for a fused one), as sharded jax.Arrays.

    For stacked parameters, `layers` lists the layer held at each index of their `layers` axis; otherwise it
    is None. `key_of(layer, entry)` is the checkpoint key of a layer (None when not stacked) and entry of the
    spec's split axis (None without one: Mixtral's experts are one tensor each). Each tensor is read once,
    as the rows that cover every shard of every member on this process's devices.
    """
    plans = [_Plan(m, layers is not None, spec.split_axis) for m in members]
    reads = []  # per tensor: (index along the plans' fixed axes, key, first row, last row, the shards it fills)
    for position, layer in enumerate(layers if layers is not None else [None]):
        for entry in spec.entries(part_sizes[0]):
            key = key_of(layer, entry)
            at = (() if layers is None else (position,)) + (() if entry is None else (entry,))
            entry_info = reader.entry(key)
            check_hf_shape(spec, entry_info.shape, part_sizes, key, truncatable)
            wanted = []
            for plan in plans:
                part = PartReader(spec, plan.member.index, tuple(part_sizes), entry_info.shape)
                wanted += [(plan, part, box) for box in plan.boxes_at(at)]
            if wanted:
                spans = [part.rows(plan.named(box)) for plan, part, box in wanted]
                first, last = min(s for s, _ in spans), max(e for _, e in spans)
                reads.append((at, key, first, last, wanted, (last - first) * entry_info.row_bytes))
    # One ranged read per tensor for all of this process's shards. At a URL, several tensors at once, up to a
    # byte budget, so that their requests' latencies overlap; locally one at a time, which holds less.
    for batch in _batches(reads, BATCH_BYTES if reader.location.remote else 0):
        rows_of = reader.rows_of([(key, first, last) for _, key, first, last, _, _ in batch])
        for (at, _, first, _, wanted, _), rows in zip(batch, rows_of, strict=True):
            for plan, part, box in wanted:
                plan.put(box, at, part.cut(rows, first, plan.named(box), plan.our_names))
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
    """The host buffers of one parameter's distinct shards on this process, filled as tensors are read.

    Its fixed axes are those that one checkpoint tensor holds a single index of: the stacked `layers` axis,
    then the spec's split axis (Mixtral's `experts`), where there are such axes.
    """

    def __init__(self, member: Member, stacked: bool, split_axis: str | None) -> None:
        self.member = member
        self.names = [a.name for a in member.leaf.axes]
        self.shape = tuple(a.size for a in member.leaf.axes)
        fixed = ([LAYERS] if stacked else []) + ([split_axis] if split_axis is not None else [])
        self.fixed = [self.names.index(n) for n in fixed]
        self.our_names = [n for k, n in enumerate(self.names) if k not in self.fixed]
        self.devices = member.sharding.addressable_devices_indices_map(self.shape)
        # jax types a device's index as optional; a NamedSharding gives every addressable device one.
        self.box_of = {device: bounds(idx, self.shape) for device, idx in self.devices.items()}  # pyright: ignore[reportArgumentType]
        self.buffers = {box: np.empty(tuple(b - a for a, b in box), member.dtype) for box in self.box_of.values()}

    def boxes_at(self, at: tuple[int, ...]) -> list[Index]:
        """The shards that hold index `at` of the fixed axes (every shard when there are none)."""
        return [b for b in self.buffers if all(b[k][0] <= i < b[k][1] for k, i in zip(self.fixed, at, strict=True))]

    def named(self, box: Index) -> dict[str, tuple[int, int]]:
        return {n: r for k, (n, r) in enumerate(zip(self.names, box, strict=True)) if k not in self.fixed}

    def put(self, box: Index, at: tuple[int, ...], block: np.ndarray) -> None:
        where: list[int | slice] = [slice(None)] * len(self.names)
        for k, i in zip(self.fixed, at, strict=True):
            where[k] = i - box[k][0]
        self.buffers[box][tuple(where)] = block

    def place(self) -> jax.Array:
        arrays = [jax.device_put(self.buffers[self.box_of[d]], d) for d in self.devices]
        # Transfers are asynchronous and keep their host buffer alive: wait, or every parameter's buffers would
        # pile up in host memory.
        jax.block_until_ready(arrays)
        self.buffers.clear()
        return jax.make_array_from_single_device_arrays(self.shape, self.member.sharding, arrays)
