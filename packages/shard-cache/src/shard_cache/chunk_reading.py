"""How a reader loads one committed chunk: read its bytes, check its checksum the first time, decode, and turn
every failure into an error that names the chunk (or rebuild the chunk from its source, when asked to)."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pyarrow as pa

from shard_cache.chunks import crc32c, decode_chunk, metadata_path, parquet_path, sha256
from shard_cache.damage import damaged_chunk_error
from shard_cache.errors import ShardCacheError
from shard_cache.fs import read_bytes

log = logging.getLogger("shard_cache")


def arrow_to_numpy(array: pa.Array) -> np.ndarray:
    """A pyarrow array as numpy: a view of its buffer when it holds fixed-width numbers and no nulls (booleans,
    which Arrow packs 8 to a byte, are unpacked).

    pyarrow's own `to_numpy` imports pandas, where it is installed, on its first call, and a run's first batch
    waited on that import: ~0.2 s from bytecode, seconds where Python cannot write bytecode.
    """
    kind = array.type
    if array.null_count == 0 and pa.types.is_boolean(kind):  # an SFT cache's loss_mask
        bits = np.unpackbits(np.frombuffer(array.buffers()[1], dtype=np.uint8), bitorder="little")
        return bits[array.offset : array.offset + len(array)].astype(bool)
    if array.null_count or not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(kind.to_pandas_dtype())  # a numpy scalar type; pandas is not imported for it
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _legacy_sha256(reader: Any, shard: int, chunk: int) -> str | None:
    """The sha256 in the metadata JSON: the only checksum of chunks committed before 0.3."""
    try:
        return str(json.loads(read_bytes(reader.fs, metadata_path(reader.root, shard, chunk)))["sha256"])
    except (FileNotFoundError, ValueError, KeyError, TypeError, ShardCacheError):
        return None


def _damage(reader: Any, shard: int, chunk: int, expected: str | None, check: bool) -> tuple[bytes | None, str]:
    """The chunk's bytes and what is wrong with them ("" when nothing is)."""
    try:
        data = read_bytes(reader.fs, parquet_path(reader.root, shard, chunk))
    except FileNotFoundError:
        return None, "the file is missing"
    if not check:
        return data, ""
    if expected is not None:
        return data, "" if crc32c(data) == expected else "its CRC-32C differs from the ledger's"
    recorded = _legacy_sha256(reader, shard, chunk)
    if recorded is None:
        return data, "its metadata JSON, which holds its checksum, is missing or damaged"
    return data, "" if sha256(data) == recorded else "its sha256 differs from its metadata JSON"


def _repair(reader: Any, shard: int, chunk: int) -> None:
    reader.repairer(shard, chunk)
    log.warning(f"{parquet_path(reader.root, shard, chunk)}: the chunk was damaged; rebuilt it from its source.")


def read_chunk_columns(
    reader: Any, shard: int, chunk: int, expected: str | None, check: bool, column: str
) -> tuple[pa.ListArray, pa.Table]:
    """Column `column` of a committed chunk, as one pyarrow array, and the table of it with the chunk's other
    list columns (per-token columns such as `loss_mask`); ChunkCorruptError (or a StorageError for an
    unreadable file) instead of a pyarrow traceback."""
    for attempt in range(2):
        data, why = _damage(reader, shard, chunk, expected, check)
        if not why:
            assert data is not None
            try:
                table = decode_chunk(data, [column], with_lists=True)
                return table.column(column).combine_chunks(), table
            except (pa.ArrowException, KeyError, OSError, ValueError) as exc:
                why = f"not readable Parquet with an {column!r} column: {exc}"
        if attempt == 0 and reader.repairer is not None:
            _repair(reader, shard, chunk)
            continue
        raise damaged_chunk_error(reader.url, reader.fs, reader.root, shard, chunk, why)
    raise AssertionError("unreachable")
