"""Chunks of a local, checksummed checkpoint written with plain file writes, byte for byte as tensorstore's zarr3
`bytes` and `crc32c` codecs write them: the chunk's little-endian bytes, then their crc32c (4 bytes, little-endian).

The crc32c is computed once per chunk and serves both the file and the manifest's digest, where tensorstore's
codec would copy each chunk into a buffer of its own and compute it a second time. Each file is fsynced before
the job reports it written, and every directory that received a file or a subdirectory is fsynced once all
of this process's chunks are written, so the manifest and the commit marker that follow never point at data
that a crash could lose. A file is written under its final name: a checkpoint is not loaded before its commit marker
exists, which is written after every chunk, so a torn file can only sit in a torn checkpoint.
"""

import concurrent.futures
import os
import sys
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

import storage_io
from dist_ckpt.direct_read import advance_buffers
from dist_ckpt.integrity import Region, region_chunks
from dist_ckpt.layout import ARRAYS_DIR
from dist_ckpt.location import Location
from dist_ckpt.objects import storage_error
from dist_ckpt.storage import chunk_key
from dist_ckpt.workers import FILE_WORKERS

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)


def writes_directly(path: Location, *, checksums: bool, ocdbt: bool) -> bool:
    """Whether an array's chunks are written with plain file writes: local disk, checksums, no OCDBT, and a
    little-endian host (the bytes in memory are then the bytes on disk)."""
    return path.is_local and checksums and not ocdbt and sys.byteorder == "little"


class DirectWrites:
    """The chunk files this process writes itself, in flight on a thread pool."""

    def __init__(self, path: Location):
        self.path = path
        self.pending: list[tuple[str, int, concurrent.futures.Future]] = []  # (array, flat position, crc32c)
        self.directories: set[Path] = set()

    def prepare(self, entry: dict[str, Any]) -> None:
        """Make the array's directory before anything else writes in it (tensorstore's metadata write on process
        0, chunk writes on every process), so that no two of them race to create it."""
        array_dir = Path(self.path.path) / ARRAYS_DIR / entry["array"]
        try:
            array_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise storage_error(error, str(array_dir), "create") from None
        self.directories.update((array_dir, array_dir.parent))

    def start_region(
        self, entry: dict[str, Any], region: Region, data: np.ndarray
    ) -> list[tuple[concurrent.futures.Future, int]]:
        """Start writing every chunk of `region` (held by `data`); [(future, bytes)] for a progress line."""
        array_dir = Path(self.path.path) / ARRAYS_DIR / entry["array"]
        shape, chunk_shape = tuple(entry["shape"]), tuple(entry["chunk_shape"])
        started = []
        for cell, flat, chunk in region_chunks(data, region, chunk_shape, shape):
            file = array_dir / chunk_key(cell)
            future = FILE_WORKERS.submit(_write_chunk, file, chunk)
            self.pending.append((entry["array"], flat, future))
            started.append((future, chunk.nbytes))
            parent = file.parent
            while parent != array_dir.parent and parent not in self.directories:
                self.directories.add(parent)
                parent = parent.parent
        return started

    def finish(self) -> dict[str, dict[int, int]]:
        """Wait for every chunk, fsync the directories that hold them; each array's chunk crc32c by position."""
        crcs: dict[str, dict[int, int]] = {}
        for array, flat, future in self.pending:
            crcs.setdefault(array, {})[flat] = future.result()
        for future in [FILE_WORKERS.submit(_fsync_directory, directory) for directory in sorted(self.directories)]:
            future.result()
        return crcs

    def abandon(self) -> None:
        """After a failure: cancel the chunks not yet started and wait for the others, so that no write lands
        in the directory after the error is reported (a retry may delete and rewrite it)."""
        for _, _, future in self.pending:
            future.cancel()
        concurrent.futures.wait([future for _, _, future in self.pending])


def _write_chunk(file: Path, chunk: np.ndarray) -> int:
    """Write one chunk file (its bytes and their crc32c) and fsync it; the crc32c."""
    # numpy's stubs give ndarray the buffer protocol only on Python >= 3.12; at run time it has it on 3.11 too.
    crc = crc32c.crc32c(chunk)  # pyright: ignore[reportArgumentType]
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(file, _FLAGS, 0o666)  # the umask decides the mode, as it does for tensorstore's files
        try:
            buffers = [memoryview(chunk), memoryview(crc.to_bytes(4, "little"))]  # pyright: ignore[reportArgumentType]
            while buffers:
                written = os.writev(fd, buffers)
                buffers = advance_buffers(buffers, written)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        raise storage_error(error, str(file), "write") from None
    return crc


def _fsync_directory(directory: Path) -> None:
    try:
        storage_io.fsync_dir(directory)
    except OSError as error:
        raise storage_error(error, str(directory), "write") from None
