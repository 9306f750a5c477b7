"""The safetensors file format: building a header for tensors to stream after it, and checking one read back.

A file is an 8-byte little-endian header length N, N bytes of JSON (padded with spaces so that the data starts
8-byte aligned) mapping each tensor name to its dtype, shape and [begin, end) byte offsets into the data that
follows, then the data: every tensor's bytes, row-major and little-endian, back to back with no gap.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import ml_dtypes
import numpy as np

from .errors import HfBridgeError

# The safetensors library refuses headers above this size; so do we (a bigger "length" is a damaged file).
MAX_HEADER_SIZE = 100_000_000
METADATA_KEY = "__metadata__"
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}  # fmt: skip
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
FIX = "Export it again (or download the checkpoint again)."


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its name, dtype name (e.g. "F32"), shape and byte range in the data."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the first axis (the whole tensor for a scalar)."""
        return math.prod(self.shape[1:]) * self.numpy_dtype.itemsize


@dataclass(frozen=True)
class Header:
    """A parsed header: where the data starts in the file, the entries in data order, and the metadata."""

    data_start: int
    entries: tuple[Entry, ...]
    metadata: dict[str, str]

    @property
    def data_size(self) -> int:
        return self.entries[-1].end if self.entries else 0

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size

    def by_key(self) -> dict[str, Entry]:
        return {e.key: e for e in self.entries}


def dtype_name(dtype: np.dtype) -> str:
    """The safetensors name of a numpy dtype."""
    try:
        return DTYPE_NAMES[np.dtype(dtype)]
    except KeyError:
        raise HfBridgeError(f"safetensors cannot store dtype {np.dtype(dtype)}.") from None


def layout(tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]]) -> list[Entry]:
    """Entries for tensors in data order, the widest dtypes first so that each tensor's data stays aligned."""
    order = sorted(tensors, key=lambda t: -np.dtype(t[1]).itemsize)  # stable: equal widths keep their order
    entries, offset = [], 0
    for key, dtype, shape in order:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        entries.append(Entry(key, dtype_name(dtype), tuple(int(n) for n in shape), offset, offset + size))
        offset += size
    return entries


def build_header(entries: Sequence[Entry], metadata: Mapping[str, str]) -> bytes:
    """The header bytes (length prefix included) that describe `entries`, to be followed by their data."""
    content: dict[str, object] = {METADATA_KEY: dict(metadata)} if metadata else {}
    for e in entries:
        content[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    text = json.dumps(content, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def header_length(prefix: bytes, file_size: int, where: str) -> int:
    """The header length from a file's first 8 bytes, checked against the file's size."""
    if file_size < 8 or len(prefix) < 8:
        raise HfBridgeError(
            f"{where} has only {file_size} bytes, too few for a safetensors file: it is truncated. {FIX}"
        )
    (n,) = struct.unpack("<Q", prefix[:8])
    if n < 2 or n > MAX_HEADER_SIZE:
        raise HfBridgeError(
            f"{where} is damaged: its first 8 bytes give a header of {n} bytes, which no safetensors file has. {FIX}"
        )
    if 8 + n > file_size:
        raise HfBridgeError(
            f"{where} is truncated: its header alone needs {8 + n} bytes but the file has {file_size}. {FIX}"
        )
    return n


def parse_header(raw: bytes, file_size: int, where: str) -> Header:
    """The header in `raw` (the file's first 8 + N bytes), checked for consistency and against the file's size."""
    n = header_length(raw, file_size, where)
    damaged = f"{where} is damaged: its header"
    try:
        content = json.loads(raw[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HfBridgeError(f"{damaged} is not valid JSON ({e}). {FIX}") from None
    if not isinstance(content, dict):
        raise HfBridgeError(f"{damaged} is not a JSON object. {FIX}")
    metadata = content.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HfBridgeError(f"{damaged} has a {METADATA_KEY} that is not an object of strings. {FIX}")
    entries = sorted((_entry(key, value, damaged) for key, value in content.items()), key=lambda e: e.begin)
    offset = 0
    for e in entries:
        if e.begin != offset:
            raise HfBridgeError(
                f"{damaged} places tensor {e.key!r} at byte {e.begin} of the data where {offset} was expected "
                f"(tensors must follow one another with no gap or overlap). {FIX}"
            )
        offset = e.end
    header = Header(8 + n, tuple(entries), dict(metadata))
    if header.file_size > file_size:
        raise HfBridgeError(
            f"{where} is truncated: its header describes {header.file_size} bytes but the file has only "
            f"{file_size} (an interrupted copy or export?). {FIX}"
        )
    if header.file_size < file_size:
        raise HfBridgeError(
            f"{where} is damaged: it has {file_size - header.file_size} bytes more than its header describes. {FIX}"
        )
    return header


def _entry(key: str, value: object, damaged: str) -> Entry:
    if not isinstance(value, dict):
        raise HfBridgeError(f"{damaged} describes tensor {key!r} with {value!r}, not an object. {FIX}")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if dtype not in DTYPES:
        raise HfBridgeError(f"{damaged} gives tensor {key!r} the unknown dtype {dtype!r}. {FIX}")
    if not _ints(shape) or not _ints(offsets) or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise HfBridgeError(f"{damaged} gives tensor {key!r} a malformed shape {shape!r} or offsets {offsets!r}. {FIX}")
    size = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != size:
        raise HfBridgeError(
            f"{damaged} gives tensor {key!r} (dtype {dtype}, shape {shape}) {offsets[1] - offsets[0]} bytes of "
            f"data where its shape needs {size}. {FIX}"
        )
    return Entry(key, dtype, tuple(shape), offsets[0], offsets[1])


def _ints(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
