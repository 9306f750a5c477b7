"""The Ray task body: process one shard into chunks, resuming after the chunks already committed."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from shard_cache.chunks import chunk_metadata, crc32c, encode_chunk, metadata_bytes, metadata_path, parquet_path
from shard_cache.errors import ShardCacheError
from shard_cache.fs import apply_storage_env, get_fs, write_atomic
from shard_cache.lock import BuildLock
from shard_cache.processor import BatchProcessor
from shard_cache.sources import DocumentReader


@dataclass(frozen=True)
class ShardTask:
    """Everything a worker needs to process one shard."""

    shard: int
    files: tuple[str, ...]
    fmt: str
    text_field: str
    on_bad_input: str
    chunk_size: int
    start_chunk: int
    cache_url: str
    lock_token: str
    worker_writes: bool
    lock_epoch: int = 0
    storage_env: tuple[tuple[str, str], ...] = ()  # the driver's standard storage settings


@dataclass
class ShardReading:
    """What reading a shard's files has counted so far: skipped documents, raw bytes, files with no document."""

    skipped: Counter[str] = field(default_factory=Counter)
    bytes_read: int = 0
    empty_files: list[str] = field(default_factory=list)


def iter_shard_chunks(
    files: tuple[str, ...],
    fmt: str,
    text_field: str,
    on_bad_input: str,
    chunk_size: int,
    reading: ShardReading,
    *,
    processor: BatchProcessor | None,
) -> Iterator[tuple[int, list[Any]]]:
    """(chunk index, documents) of every chunk of a shard, in order; `reading` is up to date at each yield.

    The builder and the repair of a damaged chunk both cut chunks here, so a repaired chunk gets the documents
    (and the skipped counts) that the build gave it. A record processor (shard_cache.records) makes each
    document from a whole record as it is read, through its `prepare` and `record_fields`.
    """
    prepare, fields = getattr(processor, "prepare", None), tuple(getattr(processor, "record_fields", ()))
    index, docs, done_bytes = 0, [], 0
    for url in files:
        reader = DocumentReader(
            url,
            fmt,  # type: ignore[arg-type]
            text_field,
            on_bad_input,  # type: ignore[arg-type]
            reading.skipped,
            prepare,
            fields,
            bool(getattr(processor, "locates_records", False)),
        )
        found = 0
        for doc in reader:
            found += 1
            reading.bytes_read = done_bytes + reader.bytes_read
            docs.append(doc)
            if len(docs) == chunk_size:
                yield index, docs
                index, docs = index + 1, []
        done_bytes += reader.bytes_read
        reading.bytes_read = done_bytes
        if found == 0:
            reading.empty_files.append(url)
    if docs:
        yield index, docs


def check_batch(batch: Any, docs: int, shard: int) -> pa.RecordBatch:
    """The processor's output as a RecordBatch of `docs` rows, or a ShardCacheError saying what it returned."""
    if isinstance(batch, pa.Table):
        batch = batch.combine_chunks().to_batches()[0] if batch.num_rows else pa.RecordBatch.from_pylist([])
    if not isinstance(batch, pa.RecordBatch) or len(batch) != docs:
        got = f"{type(batch).__name__} of {len(batch)} rows" if hasattr(batch, "__len__") else type(batch).__name__
        raise ShardCacheError(
            f"shard {shard}: the processor returned {got} for {docs} documents. A processor must return a "
            "pyarrow RecordBatch with one row per document."
        )
    return batch


# The processor of the build this worker process last served, by object id: a Ray worker runs many shards of
# one build, and a tokenizer deserialised once keeps its word cache warm from one shard to the next.
_warm_processor: dict[str, BatchProcessor] = {}


def process_shard_in_worker(task: ShardTask, processor_ref: list[Any]) -> Iterator[dict[str, Any]]:
    """The Ray task: process_shard with the build's processor, fetched once per worker process.

    The object ref comes wrapped in a list so that Ray hands it over unresolved instead of deserialising the
    processor again for every shard.
    """
    import ray

    (ref,) = processor_ref
    key = ref.hex()
    if key not in _warm_processor:
        _warm_processor.clear()
        _warm_processor[key] = ray.get(ref)
    node = ray.get_runtime_context().get_node_id()
    for message in process_shard(task, _warm_processor[key]):
        if message.get("done"):
            message["node"] = node  # which Ray node tokenized the shard: the build counts the nodes it used
        yield message


def process_shard(task: ShardTask, processor: BatchProcessor) -> Generator[dict[str, Any], None, None]:
    """Yield one message per new chunk (written here, or carried as bytes), then a final `done` message."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the Ray workers are the parallelism
    apply_storage_env(dict(task.storage_env))
    fs, root = get_fs(task.cache_url)
    lock = BuildLock(fs=fs, root=root, token=task.lock_token, epoch=task.lock_epoch)
    reading = ShardReading()
    chunks = iter_shard_chunks(
        task.files, task.fmt, task.text_field, task.on_bad_input, task.chunk_size, reading, processor=processor
    )
    for chunk_index, docs in chunks:
        if chunk_index < task.start_chunk:
            continue  # committed by an earlier build: read through, not tokenized again
        batch = check_batch(processor(docs), len(docs), task.shard)
        data = encode_chunk(batch)
        meta = chunk_metadata(batch, data, reading.skipped)
        message: dict[str, Any] = {"chunk": chunk_index, "meta": meta, "crc32c": crc32c(data)}
        message["bytes_read"] = reading.bytes_read
        if task.worker_writes:
            if not lock.still_held():
                raise lock.lost()
            write_atomic(fs, parquet_path(root, task.shard, chunk_index), data)
            write_atomic(fs, metadata_path(root, task.shard, chunk_index), metadata_bytes(meta))
        else:
            message["data"] = data
        yield message
    yield {
        "done": True,
        "skipped": dict(reading.skipped),
        "empty_files": list(reading.empty_files),
        "bytes_read": reading.bytes_read,
    }
