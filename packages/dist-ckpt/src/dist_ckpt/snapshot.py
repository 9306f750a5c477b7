"""The synchronous half of a save: describe each leaf and copy this process's shards to host memory."""

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from dist_ckpt.distributed import process_index
from dist_ckpt.storage import chunk_shape_for, numpy_dtype
from dist_ckpt.tree import Leaf, array_names, flatten, leaf_kind

Region = tuple[tuple[int, int], ...]


@dataclass
class ArrayPieces:
    """One saved array: its manifest entry and the host copies of the regions this process writes."""

    entry: dict[str, Any]
    regions: list[Region] = field(default_factory=list)
    data: list[np.ndarray] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.data)


@dataclass
class Snapshot:
    """Everything the background write needs, already off the devices."""

    entries: list[dict[str, Any]]
    arrays: list[ArrayPieces]

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays)


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    return tuple((s.indices(size)[0], s.indices(size)[1]) for s, size in zip(index, shape, strict=True))


def _check_tiles(leaf: Leaf, region: Region, chunk: list[int]) -> None:
    """Two shards must never share a chunk (two writers, and no one checksum): shards start on chunk edges."""
    if any(start % size for (start, _), size in zip(region, chunk, strict=True)):
        raise ValueError(
            f"Leaf {leaf.path}: a shard starts at {[start for start, _ in region]}, not on the chunk grid "
            f"{chunk}, so two processes could write the same chunk. Use an evenly dividing sharding "
            "(e.g. a NamedSharding over the mesh) for this array."
        )


def _jax_pieces(leaf: Leaf, entry: dict[str, Any], ocdbt: bool) -> ArrayPieces:
    array: jax.Array = leaf.value
    chunk = chunk_shape_for(array.sharding.shard_shape(array.shape), array.dtype.itemsize)
    entry.update(kind="array", source="jax", chunk_shape=chunk, ocdbt=ocdbt)
    pieces = ArrayPieces(entry)
    # replica_id 0 picks one copy of each region across all processes: each region is written exactly once.
    shards = [shard for shard in array.addressable_shards if shard.replica_id == 0]
    for shard in shards:
        shard.data.copy_to_host_async()  # start every transfer before waiting on any
    for shard in shards:
        region = _region(shard.index, array.shape)
        _check_tiles(leaf, region, chunk)
        pieces.regions.append(region)
        pieces.data.append(np.array(shard.data, copy=True))  # a private copy: the caller may donate buffers
    return pieces


def _numpy_pieces(leaf: Leaf, entry: dict[str, Any], ocdbt: bool) -> ArrayPieces:
    value = np.asarray(leaf.value)
    entry.update(kind="array", source="numpy", chunk_shape=chunk_shape_for(value.shape, value.dtype.itemsize))
    entry["ocdbt"] = ocdbt
    pieces = ArrayPieces(entry)
    if process_index() == 0:  # host-local values are taken to be equal on every process, as jax assumes
        pieces.regions.append(tuple((0, size) for size in value.shape))
        pieces.data.append(np.array(value, copy=True))
    return pieces


def take_snapshot(tree: Any, *, ocdbt: bool) -> Snapshot:
    """Describe every leaf of `tree` and copy the regions this process must write to host memory."""
    leaves, _ = flatten(tree)
    kinds = [leaf_kind(leaf) for leaf in leaves]  # validate every leaf before copying anything
    entries: list[dict[str, Any]] = []
    arrays: list[ArrayPieces] = []
    for leaf, kind, name in zip(leaves, kinds, array_names(leaves), strict=True):
        entry: dict[str, Any] = {"path": leaf.path}
        if kind == "scalar":
            entry.update(kind="scalar", python_type=type(leaf.value).__name__, value=leaf.value)
        else:
            value = leaf.value
            entry.update(array=name, dtype=np.dtype(value.dtype).name, shape=list(np.shape(value)))
            pieces = _jax_pieces(leaf, entry, ocdbt) if kind == "jax" else _numpy_pieces(leaf, entry, ocdbt)
            arrays.append(pieces)
        entries.append(entry)
    return Snapshot(entries, arrays)


def check_metadata(metadata: Mapping[str, Any] | None, path: str) -> dict[str, Any]:
    """User metadata as a JSON-ready dict, or a clear error naming what cannot be stored."""
    if metadata is None:
        return {}
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"metadata for checkpoint {path} must be JSON-serializable (dicts, lists, str, numbers, bools, "
            f"None): {error}. Convert the offending values (e.g. numpy scalars with .item())."
        ) from error


def total_bytes(entries: list[dict[str, Any]]) -> int:
    """Bytes of all arrays described by manifest entries."""
    return sum(
        math.prod(entry["shape"]) * numpy_dtype(entry["dtype"]).itemsize
        for entry in entries
        if entry["kind"] == "array"
    )
