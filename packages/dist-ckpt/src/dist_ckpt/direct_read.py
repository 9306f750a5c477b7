"""Whole chunks of a local checkpoint read with plain file reads, checked as tensorstore's crc32c codec checks them.

Each chunk file is the chunk's little-endian bytes and their crc32c. Reading it straight into the output buffer,
then checking the crc32c against the file's own and the manifest's, is the same check as tensorstore's zarr3
`crc32c` codec plus the manifest digest, without the codec's buffer and copy per chunk.
"""

import concurrent.futures
import itertools
import math
import os
import sys
from typing import Any

import crc32c
import numpy as np

from dist_ckpt.integrity import chunk_grid, unpack_crcs
from dist_ckpt.layout import corrupt
from dist_ckpt.location import Location
from dist_ckpt.objects import storage_error
from dist_ckpt.storage import CHECKSUM_BYTES, chunk_key
from dist_ckpt.workers import FILE_WORKERS

_OUR_CODECS = ["bytes", "crc32c"]


def readable_directly(path: Location, entry: dict[str, Any], store: Any, key: Any, chunk: tuple[int, ...]) -> bool:
    """Whether a whole-chunk region can be read with plain file reads: a local, checksummed, little-endian array
    whose region holds only full chunks."""
    if not path.is_local or entry.get("ocdbt", False) or "chunk_crc32c" not in entry or sys.byteorder != "little":
        return False
    codecs = store.codec.to_json().get("codecs", [])
    if [c.get("name") for c in codecs] != _OUR_CODECS:
        return False
    if codecs[0].get("configuration", {}).get("endian", "little") != "little":
        return False
    return all((stop - start) % size == 0 for (start, stop), size in zip(key, chunk, strict=True))


def read_directly(
    path: Location, entry: dict[str, Any], key: Any, chunk: tuple[int, ...], out: np.ndarray, url: str
) -> concurrent.futures.Future:
    """Start filling `out` (the region `key`) from its chunk files; the future's result is `out`."""
    return FILE_WORKERS.submit(_read_region, path, entry, key, chunk, out, url)


def _read_region(
    path: Location, entry: dict[str, Any], key: Any, chunk: tuple[int, ...], out: np.ndarray, url: str
) -> np.ndarray:
    grid = chunk_grid(tuple(entry["shape"]), chunk)
    expected = unpack_crcs(entry)
    chunk_bytes = math.prod(chunk) * out.dtype.itemsize
    ranges = [range(start // size, stop // size) for (start, stop), size in zip(key, chunk, strict=True)]
    whole = out.shape == chunk  # one chunk: read straight into the output buffer
    for cell in itertools.product(*ranges):
        file = f"{url}/{chunk_key(cell)}"
        target = out.reshape(-1).view(np.uint8) if whole else np.empty(chunk_bytes, np.uint8)
        crc = _read_chunk(path, entry, file, target)
        wanted = int(expected[int(np.ravel_multi_index(cell, grid))])
        if crc != wanted:
            raise corrupt(
                path,
                file,
                f"holds a chunk whose data (crc32c {crc:#010x}) is not the one the manifest records ({wanted:#010x}): "
                "the file was replaced by another chunk, or altered along with its checksum",
                key=entry["path"],
            )
        if not whole:
            local = tuple(
                slice(c * size - start, (c + 1) * size - start)
                for c, size, (start, _) in zip(cell, chunk, key, strict=True)
            )
            out[local] = target.view(out.dtype).reshape(chunk)
    return out


def _read_chunk(path: Location, entry: dict[str, Any], file: str, target: np.ndarray) -> int:
    """Read one chunk file into `target`; its crc32c, once it matches the one stored at the end of the file."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        raise corrupt(path, file, "is missing", key=entry["path"]) from None
    except OSError as error:
        raise storage_error(error, file, "read") from None
    trailer = bytearray(CHECKSUM_BYTES)
    try:
        size = os.fstat(fd).st_size
        if size != target.nbytes + CHECKSUM_BYTES:
            what = "is truncated (shorter than the chunk it must hold)" if size < target.nbytes else "cannot be decoded"
            raise corrupt(
                path,
                file,
                f"{what}: {size} bytes where the chunk and its checksum take {target.nbytes + CHECKSUM_BYTES}",
                key=entry["path"],
            )
        # numpy's stubs give ndarray the buffer protocol only on Python >= 3.12; at run time it has it on 3.11 too.
        buffers, offset = [memoryview(target), memoryview(trailer)], 0  # pyright: ignore[reportArgumentType]
        while offset < size:
            got = os.preadv(fd, buffers, offset)
            if got == 0:
                raise corrupt(path, file, "is truncated (shorter than the chunk it must hold)", key=entry["path"])
            offset += got
            buffers = advance_buffers(buffers, got)
    except OSError as error:
        raise storage_error(error, file, "read") from None
    finally:
        os.close(fd)
    crc = crc32c.crc32c(target)  # pyright: ignore[reportArgumentType] (ndarray: see above)
    if crc != int.from_bytes(trailer, "little"):
        raise corrupt(
            path,
            file,
            "fails its checksum: its bytes changed after they were written (a flipped bit, an overwrite)",
            key=entry["path"],
        )
    return crc


def advance_buffers(buffers: list[memoryview], count: int) -> list[memoryview]:
    """The buffers still to fill (or write out) after a read (or write) of `count` bytes of them."""
    left = []
    for buffer in buffers:
        if count >= len(buffer):
            count -= len(buffer)
            continue
        left.append(buffer[count:])
        count = 0
    return left
