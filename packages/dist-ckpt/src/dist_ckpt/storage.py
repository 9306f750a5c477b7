"""Tensorstore specs for the arrays of a checkpoint: zarr3 on local disk or in a bucket, optionally in OCDBT,
with a crc32c checksum at the end of every chunk."""

import math
import os
from typing import Any

import numpy as np
import tensorstore as ts

from dist_ckpt.layout import ARRAYS_DIR, OCDBT_DIR
from dist_ckpt.location import Location
from dist_ckpt.retries import retry_policy, tensorstore_retries

# Chunks above this size are split (evenly, inside one shard) so that a reshard on load reads little
# more than it needs and tensorstore can write several chunks of one shard in parallel.
MAX_CHUNK_BYTES = 64 * 2**20
CHECKSUM_BYTES = 4  # zarr3's crc32c codec appends a little-endian crc32c of the encoded chunk


def make_context(ocdbt_coordinator: str | None = None) -> ts.Context:
    """A tensorstore context for one save or load, with more I/O in flight than tensorstore's default and the
    retry policy in force for buckets.

    `ocdbt_coordinator` (host:port) lets several processes write one OCDBT database.
    """
    # Measured on a 2-core machine: 16 concurrent file operations and copies read up to ~2x faster than the
    # defaults, which follow the core count and leave the disk idle while a core waits.
    limit = max(16, os.cpu_count() or 1)
    spec: dict[str, Any] = {
        "file_io_concurrency": {"limit": limit},
        "data_copy_concurrency": {"limit": limit},
        **tensorstore_retries(retry_policy()),
    }
    if ocdbt_coordinator is not None:
        spec["ocdbt_coordinator"] = {"address": ocdbt_coordinator}
    return ts.Context(spec)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name as stored in a manifest (bfloat16 and float8 types included)."""
    return np.dtype(ts.dtype(name).numpy_dtype)


def chunk_shape_for(shard_shape: tuple[int, ...], itemsize: int) -> list[int]:
    """A chunk shape that tiles `shard_shape` exactly and holds at most MAX_CHUNK_BYTES when possible."""
    chunk = list(shard_shape)
    while math.prod(chunk) * itemsize > MAX_CHUNK_BYTES:
        # Halve the largest even dimension; chunks must tile the shard so that no chunk spans two writers.
        candidates = [i for i, size in enumerate(chunk) if size % 2 == 0]
        if not candidates:
            break
        largest = max(candidates, key=lambda i: chunk[i])
        chunk[largest] //= 2
    return [max(size, 1) for size in chunk]


def array_kvstore(checkpoint: Location, name: str, *, ocdbt: bool) -> dict[str, Any]:
    """The kvstore spec of one saved array's directory (inside the OCDBT database when `ocdbt`)."""
    if ocdbt:
        return {"driver": "ocdbt", "base": checkpoint.kvstore_spec(OCDBT_DIR), "path": name + "/"}
    return checkpoint.kvstore_spec(f"{ARRAYS_DIR}/{name}")


def array_spec(
    checkpoint: Location,
    name: str,
    *,
    ocdbt: bool,
    dtype: np.dtype,
    shape: list[int],
    chunk_shape: list[int],
    checksums: bool = True,
) -> dict[str, Any]:
    """The full tensorstore spec (metadata included) of one array to save."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if checksums:
        codecs.append({"name": "crc32c"})
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": array_kvstore(checkpoint, name, ocdbt=ocdbt),
        "metadata": {
            "shape": shape,
            "data_type": ts.dtype(np.dtype(dtype).name).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk_shape}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "codecs": codecs,
        },
    }
    if checksums:
        # Every chunk is stored, zeros included, so that a missing chunk file means damage, not zeros.
        spec["store_data_equal_to_fill_value"] = True
    return spec


def chunk_key(cell: tuple[int, ...]) -> str:
    """The key of a chunk (by its position in the chunk grid) inside its array's directory."""
    return "/".join(["c", *(str(i) for i in cell)])


def open_for_write(spec: dict[str, Any], context: ts.Context, *, create_metadata: bool) -> ts.Future:
    """Open an array to write; only one process writes its metadata, the others assume it."""
    if create_metadata:
        return ts.open(spec, create=True, context=context)
    return ts.open(spec, open=True, assume_metadata=True, context=context)


def open_for_read(checkpoint: Location, entry: dict[str, Any], context: ts.Context) -> ts.Future:
    """Open a saved array (described by its manifest entry) to read, from the metadata that is stored."""
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": array_kvstore(checkpoint, entry["array"], ocdbt=entry.get("ocdbt", False)),
    }
    if "chunk_crc32c" in entry:
        spec["fill_missing_data_reads"] = False  # every chunk was stored: a missing one is damage
    return ts.open(spec, open=True, read=True, context=context)
