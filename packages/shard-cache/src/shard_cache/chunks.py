"""Chunk files: a Parquet file of a fixed number of documents, and its metadata JSON (the chunk's commit marker).

Each chunk has two checksums: the sha256 of its bytes in its metadata JSON, which `verify` checks, and a
CRC-32C in the ledger, which readers check the first time they open the chunk (hardware CRC: about 1% of
the Parquet decode).
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import TYPE_CHECKING, Any

import google_crc32c

from shard_cache.fs import join

if TYPE_CHECKING:  # pyarrow is imported where chunks are made or read, so that `inspect` starts without it
    import pyarrow as pa

CHUNKS_DIR = "chunks"


def chunk_stem(root: str, shard: int, chunk: int) -> str:
    """Path of a chunk without suffix: <root>/chunks/<shard>/<chunk>."""
    return join(root, CHUNKS_DIR, f"{shard:05d}", f"{chunk:06d}")


def parquet_path(root: str, shard: int, chunk: int) -> str:
    return chunk_stem(root, shard, chunk) + ".parquet"


def metadata_path(root: str, shard: int, chunk: int) -> str:
    return chunk_stem(root, shard, chunk) + ".json"


def crc32c(data: bytes) -> str:
    """The CRC-32C of `data` as 8 hex digits (what the ledger records per chunk)."""
    return f"{google_crc32c.value(data):08x}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def token_counts(batch: pa.RecordBatch | pa.Table) -> dict[str, int]:
    """Number of values in each list column (tokens per field)."""
    import pyarrow as pa

    counts = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            flat = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
            counts[name] = len(flat.flatten())
    return counts


def encode_chunk(batch: pa.RecordBatch) -> bytes:
    """Parquet bytes of one chunk; the same batch always gives the same bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_batches([batch]), buffer, compression="zstd", row_group_size=len(batch) or 1)
    return buffer.getvalue()


def decode_chunk(data: bytes, columns: list[str] | None = None, *, with_lists: bool = False) -> pa.Table:
    """The table in a chunk's bytes, decoded on this thread alone.

    `with_lists` adds the chunk's other list columns to `columns` (per-token columns such as `loss_mask`), and its
    string columns (per-document values such as a prompt cache's `record`).

    No Arrow thread may hold a reference to the Python-owned `data`: a worker that drops the last one after
    the interpreter began to finalise must take the GIL, is ended by Python inside a C++ destructor, and the
    process aborts ("terminate called without an active exception", exit 134). `pq.read_table` scans through
    pyarrow.dataset's thread pools; `ParquetFile.read` with threads decodes on the CPU pool, whose tasks can
    release their buffer slices just after `read` returns. With a column or two per chunk, threads gain nothing.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
    try:
        if with_lists and columns is not None:
            kept = (pa.types.is_list, pa.types.is_string)
            lists = [f.name for f in parquet.schema_arrow if any(k(f.type) for k in kept) and f.name not in columns]
            columns = [*columns, *lists]
        return parquet.read(columns=columns, use_threads=False)
    finally:
        parquet.close()


def chunk_metadata(batch: pa.RecordBatch, data: bytes, skipped: dict[str, int]) -> dict[str, Any]:
    """The metadata JSON of a chunk: documents, tokens per field, bytes, sha256, skipped documents so far."""
    return {
        "docs": len(batch),
        "tokens": token_counts(batch),
        "bytes": len(data),
        "sha256": sha256(data),
        "skipped_so_far": dict(sorted(skipped.items())),
    }


def metadata_bytes(meta: dict[str, Any]) -> bytes:
    return (json.dumps(meta, sort_keys=True) + "\n").encode("utf-8")
