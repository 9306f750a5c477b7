"""Checksums of saved arrays, and what a damaged file looks like to the caller.

Every chunk of a checkpoint written with checksums ends with the crc32c of its bytes (zarr3's `crc32c` codec),
which tensorstore checks whenever it decodes the chunk. The manifest carries each array's digest: the crc32c
of every chunk, in the C order of the chunk grid, computed from the data in memory before it was written. A
load compares the chunks it reads with the manifest's digest (from the data, for whole chunks; from the
checksum stored at the end of the chunk otherwise), which also catches a chunk file that is valid on its own
but not the one that was saved (replaced, or copied from another checkpoint); a missing chunk is an error
rather than zeros.
"""

import base64
import itertools
import math
import re
from collections.abc import Iterator
from typing import Any

import crc32c
import numpy as np
import tensorstore as ts

from dist_ckpt.errors import CheckpointError
from dist_ckpt.layout import corrupt
from dist_ckpt.location import Location
from dist_ckpt.objects import storage_error, tensorstore_status
from dist_ckpt.storage import CHECKSUM_BYTES, chunk_key, numpy_dtype

Region = tuple[tuple[int, int], ...]
_QUOTED = re.compile(r'"([^"\s]+)"')
_URL = re.compile(r"\b((?:s3|gs|gcs|file)://[^\s\"',\]]+)")
_STORAGE_STATUSES = {"PERMISSION_DENIED", "UNAUTHENTICATED", "ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}


def chunk_grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The number of chunks along each axis."""
    return tuple(math.ceil(size / chunk) for size, chunk in zip(shape, chunk_shape, strict=True))


def cells_overlapping(region: Region, chunk_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The grid positions of the chunks that intersect `region` (start, stop per axis)."""
    ranges = [
        range(start // chunk, math.ceil(stop / chunk)) if stop > start else range(0)
        for (start, stop), chunk in zip(region, chunk_shape, strict=True)
    ]
    return list(itertools.product(*ranges))


def _chunk_bytes(block: np.ndarray, chunk_shape: tuple[int, ...]) -> np.ndarray:
    """The bytes the `bytes` codec stores for a chunk: little-endian, C order, padded to the full chunk shape."""
    dtype = block.dtype.newbyteorder("<") if block.dtype.byteorder == ">" else block.dtype
    if block.shape != tuple(chunk_shape):  # an edge chunk: zarr stores it whole, the rest filled with zeros
        full = np.zeros(chunk_shape, dtype)
        full[tuple(slice(0, size) for size in block.shape)] = block
        block = full
    return np.ascontiguousarray(block, dtype=dtype).reshape(-1).view(np.uint8)


def region_chunks(
    data: np.ndarray, region: Region, chunk_shape: tuple[int, ...], shape: tuple[int, ...]
) -> Iterator[tuple[tuple[int, ...], int, np.ndarray]]:
    """Each chunk that lies inside `region`: (grid position, flat position in the chunk grid, the bytes the
    `bytes` codec stores for it), for `data` holding that region.

    Chunks tile the shards (saves check it), so every chunk lies inside the region of one writer.
    """
    grid = chunk_grid(shape, chunk_shape)
    for cell in cells_overlapping(region, chunk_shape):
        lo = [index * chunk for index, chunk in zip(cell, chunk_shape, strict=True)]
        hi = [min(start + chunk, size) for start, chunk, size in zip(lo, chunk_shape, shape, strict=True)]
        if any(a < start or b > stop for a, b, (start, stop) in zip(lo, hi, region, strict=True)):
            raise ValueError(f"chunk {cell} of shape {chunk_shape} straddles the written region {region}")
        block = data[tuple(slice(a - start, b - start) for a, b, (start, _) in zip(lo, hi, region, strict=True))]
        flat = int(np.ravel_multi_index(cell, grid)) if grid else 0
        yield cell, flat, _chunk_bytes(block, chunk_shape)


def region_crcs(
    data: np.ndarray, region: Region, chunk_shape: tuple[int, ...], shape: tuple[int, ...]
) -> dict[int, int]:
    """crc32c of each chunk that lies inside `region`, keyed by its flat position in the chunk grid."""
    # numpy's stubs give ndarray the buffer protocol only on Python >= 3.12; at run time it has it on 3.11 too.
    chunks = region_chunks(data, region, chunk_shape, shape)
    return {flat: crc32c.crc32c(chunk) for _, flat, chunk in chunks}  # pyright: ignore[reportArgumentType]


def pack_crcs(crcs: dict[int, int], count: int, name: str) -> str:
    """The manifest's digest of an array: every chunk's crc32c, as base64 of little-endian uint32s."""
    missing = sorted(set(range(count)) - set(crcs))
    if missing:
        raise CheckpointError(
            f"Array {name}: no process reported the checksum of chunks {missing[:10]} (of {count}); every chunk "
            "must have exactly one writer. This is a bug in dist_ckpt: please report it."
        )
    return base64.b64encode(np.array([crcs[i] for i in range(count)], "<u4").tobytes()).decode()


def unpack_crcs(entry: dict[str, Any]) -> np.ndarray:
    """The chunk checksums recorded in a manifest entry."""
    return np.frombuffer(base64.b64decode(entry["chunk_crc32c"]), "<u4")


def chunk_nbytes(entry: dict[str, Any]) -> int:
    """Bytes of one encoded chunk of the array (before its checksum)."""
    return math.prod(entry["chunk_shape"]) * numpy_dtype(entry["dtype"]).itemsize


def read_trailers(store: ts.TensorStore, entry: dict[str, Any], cells: list[tuple[int, ...]], batch: ts.Batch) -> list:
    """Start reading the checksum stored at the end of each listed chunk: [(cell, key, future)]."""
    kvstore = store.kvstore
    assert kvstore is not None  # every checkpoint array is opened on a kvstore
    offset = chunk_nbytes(entry)
    span = slice(offset, offset + CHECKSUM_BYTES)
    return [(cell, chunk_key(cell), kvstore.read(chunk_key(cell), byte_range=span, batch=batch)) for cell in cells]


def check_trailers(checkpoint: Location, entry: dict[str, Any], pending: list, array_url: str) -> None:
    """Compare the stored checksums read by read_trailers with the manifest's; raise on the first difference."""
    expected = unpack_crcs(entry)
    grid = chunk_grid(tuple(entry["shape"]), tuple(entry["chunk_shape"]))
    for cell, key, future in pending:
        file = f"{array_url}/{key}"
        try:
            result = future.result()
        except ValueError as error:
            raise array_error(error, checkpoint, entry, file) from None
        if result.state != "value":
            raise corrupt(checkpoint, file, "is missing", key=entry["path"])
        stored = int.from_bytes(result.value, "little")
        wanted = int(expected[int(np.ravel_multi_index(cell, grid)) if grid else 0])
        if stored != wanted:
            raise corrupt(
                checkpoint,
                file,
                f"holds a chunk whose checksum (crc32c {stored:#010x}) is not the one the manifest records "
                f"({wanted:#010x}): the file was altered, or replaced by another chunk",
                key=entry["path"],
            )


def _message(error: BaseException) -> str:
    """tensorstore's message without the spec and source locations it appends."""
    return str(error).split(" [tensorstore_spec=")[0].split(" [source locations=")[0]


def file_in_message(text: str, checkpoint: Location, fallback: str) -> str:
    """The file or object a tensorstore message is about, as a path or URL (its messages quote a bucket's
    objects by key alone)."""
    for quoted in _QUOTED.findall(text):
        if quoted.startswith(checkpoint.path + "/"):  # a local path, or an object's key in the bucket
            return quoted if checkpoint.is_local else f"{checkpoint.scheme}://{checkpoint.bucket}/{quoted}"
    for url in _QUOTED.findall(text) + _URL.findall(text):
        if url.startswith(("s3://", "gs://", "gcs://", "file://")):
            return str(Location.parse(url.replace("gcs://", "gs://", 1)))
    return fallback


def array_error(error: BaseException, checkpoint: Location, entry: dict[str, Any], fallback: str) -> CheckpointError:
    """A tensorstore error while reading an array, as CorruptCheckpointError or StorageError naming the file."""
    text = _message(error)
    file = file_in_message(text, checkpoint, fallback)
    status = tensorstore_status(error)
    if status in _STORAGE_STATUSES or "CURL error" in text:
        return storage_error(RuntimeError(text), file, "read")
    if "Digest mismatch" in text:
        what = "fails its checksum: its bytes changed after they were written (a flipped bit, an overwrite)"
    elif "Not enough data" in text or status == "OUT_OF_RANGE":
        what = "is truncated (shorter than the chunk it must hold)"
    elif status == "NOT_FOUND":
        what = "is missing"
    else:
        what = "cannot be decoded"
    return corrupt(checkpoint, file, f"{what} [tensorstore: {text}]", key=entry["path"])


def write_error(error: BaseException, checkpoint: Location) -> CheckpointError:
    """A tensorstore error while writing arrays, as a StorageError naming the file and the fix."""
    text = _message(error)
    return storage_error(RuntimeError(text), file_in_message(text, checkpoint, str(checkpoint)), "write")
