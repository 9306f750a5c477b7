"""Writing safetensors checkpoints one tensor at a time: tensors planned into files by size, each file's header
written first (every shape is known before any data is fetched), then each tensor's bytes as it is made.

Host memory holds one tensor at a time, whatever the size of the model or of a file.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import HfBridgeError
from .multihost import Coordinator
from .reader import INDEX_FILE, SINGLE_FILE
from .st_format import Entry, build_header, layout

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30, "TIB": 2**40}  # fmt: skip
# transformers checks this metadata to know the tensors' framework layout.
METADATA = {"format": "pt"}
# Writes go out in pieces of at most this size, so that a remote file's upload buffer stays small.
WRITE_CHUNK = 8 * 2**20

Progress = Callable[[int, int], None]


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB" or "2GiB" (decimal units like transformers)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match and match.group(2).upper() in UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * UNITS[match.group(2).upper()])
    raise HfBridgeError(f"max_shard_size={size!r} is not a size; use bytes (an int) or a string like '5GB' or '500MB'.")


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its key, dtype and shape, and how to make its data (None on processes that don't write).

    `make(writer)` is called on every process in the same order: it may be a collective.
    """

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    make: Callable[[bool], np.ndarray | None]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class WrittenFile:
    """What was written to one file: its name, header bytes, size, entries and the CRC-32 of each tensor's data."""

    name: str
    header: bytes
    entries: list[Entry]
    crc32: dict[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.header) + (self.entries[-1].end if self.entries else 0)


def plan_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[list[PlannedTensor]]:
    """Tensors grouped in order into shards of at most max_shard_size bytes (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    used = 0
    for t in tensors:
        if shards[-1] and used + t.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of a checkpoint in `count` files, as transformers names them."""
    return [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_shards(out: Any, shards: list[list[PlannedTensor]], co: Coordinator, progress: Progress | None = None):
    """Write every file (tensor by tensor) and, for several files, the index; returns the WrittenFiles.

    `out` creates files by name (`out.create(name)` -> a binary file object). Every process calls this; the
    writer (process 0) writes, and all agree on its outcome after each file.
    """
    names = shard_names(len(shards))
    total = sum(t.nbytes for shard in shards for t in shard)
    done = 0
    written = []
    for name, shard in zip(names, shards, strict=True):
        by_key = {t.key: t for t in shard}
        entries = layout([(t.key, t.dtype, t.shape) for t in shard])
        record = WrittenFile(name, build_header(entries, METADATA), entries)
        handle = co.run(lambda name=name, record=record: _start(out, name, record.header))
        for entry in entries:
            data = by_key[entry.key].make(co.writer)
            co.run(
                lambda entry=entry, data=data, handle=handle, record=record: _write(out, handle, record, entry, data)
            )
            del data
            done += entry.end - entry.begin
            if progress is not None and co.writer:
                progress(done, total)
        co.run(lambda handle=handle, name=name: _finish(out, handle, name))
        co.agree()
        written.append(record)
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {e.key: r.name for r in written for e in r.entries}}
        co.run(lambda: out.write_bytes(INDEX_FILE, index_bytes(index)))
    co.agree()
    return written


def index_bytes(index: dict[str, Any]) -> bytes:
    """The bytes of an index file (sorted keys, like transformers writes it)."""
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _start(out: Any, name: str, header: bytes) -> Any:
    handle = out.create(name)
    out.guard(lambda: handle.write(header), name)
    return handle


def _write(out: Any, handle: Any, record: WrittenFile, entry: Entry, data: np.ndarray | None) -> None:
    if data is None or tuple(data.shape) != entry.shape or data.dtype != entry.numpy_dtype:
        raise HfBridgeError(
            f"hf_bridge made tensor {entry.key!r} with shape {getattr(data, 'shape', None)} where it planned "
            f"{entry.shape} ({entry.dtype}); please report this."
        )
    # numpy's stubs give ndarray the buffer protocol only on Python >= 3.12; at run time it has it on 3.11 too.
    raw = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))  # pyright: ignore[reportArgumentType]
    crc = 0
    for start in range(0, len(raw), WRITE_CHUNK):
        piece = raw[start : start + WRITE_CHUNK]
        crc = zlib.crc32(piece, crc)
        out.guard(lambda piece=piece: handle.write(piece), record.name)
    record.crc32[entry.key] = crc


def _finish(out: Any, handle: Any, name: str) -> None:
    out.guard(handle.close, name)
