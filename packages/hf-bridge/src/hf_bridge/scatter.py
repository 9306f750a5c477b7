"""Reading one parameter of ours from a checkpoint straight into its sharded layout.

Each process reads only what its own devices hold: for every distinct shard on its devices, the rows of each
checkpoint tensor that cover the shard (one ranged read per tensor for all of them), cut out in our axis order
into a host buffer of the shard's size, which then goes to its devices. No process holds the whole model,
nor, when the parameter is sharded across processes, the whole parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from named_tensors import NamedArray

from .gather import _bounds
from .layout import HfTensor, PartReader, check_hf_shape
from .params import LAYERS
from .reader import CheckpointReader


def read_parameter(
    reader: CheckpointReader,
    key_of: Callable[[int | None], str],
    spec: HfTensor,
    index: int,
    part_sizes: list[dict[str, int]],
    leaf: NamedArray,
    layers: list[int] | None,
    sharding: jax.sharding.Sharding,
    dtype: np.dtype,
    truncatable: frozenset[str],
) -> jax.Array:
    """The parameter `leaf` (its shape and axes) as a jax.Array with `sharding`, read from the checkpoint.

    For a stacked leaf, `layers` lists the layer held at each index of its `layers` axis; for any other it is
    None and `key_of(None)` is the one checkpoint key to read.
    """
    names = [a.name for a in leaf.axes]
    shape = tuple(a.size for a in leaf.axes)
    layer_axis = names.index(LAYERS) if layers is not None else None
    our_names = [n for k, n in enumerate(names) if k != layer_axis]
    devices = sharding.addressable_devices_indices_map(shape)
    box_of = {device: _bounds(idx, shape) for device, idx in devices.items()}
    buffers = {box: np.empty(tuple(b - a for a, b in box), dtype) for box in box_of.values()}
    for position, layer in enumerate(layers if layers is not None else [None]):
        wanted = [b for b in buffers if layer_axis is None or b[layer_axis][0] <= position < b[layer_axis][1]]
        if not wanted:
            continue
        key = key_of(layer)
        entry = reader.entry(key)
        check_hf_shape(spec, entry.shape, part_sizes, key, truncatable)
        part = PartReader(spec, index, tuple(part_sizes), entry.shape)
        ours = {b: {n: r for k, (n, r) in enumerate(zip(names, b, strict=True)) if k != layer_axis} for b in wanted}
        spans = [part.rows(box) for box in ours.values()]
        first, last = min(s for s, _ in spans), max(e for _, e in spans)
        rows = reader.rows(key, first, last)  # one ranged read for every shard of this process
        for b, box in ours.items():
            block = part.cut(rows, first, box, our_names)
            if layer_axis is None:
                buffers[b][...] = block
            else:
                buffers[b][(slice(None),) * layer_axis + (position - b[layer_axis][0],)] = block
        del rows
    arrays = [jax.device_put(buffers[box_of[d]], d) for d in devices]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
