"""The Ray task body: process one shard into chunks, resuming after the chunks already committed."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from shard_cache.chunks import chunk_metadata, encode_chunk, metadata_bytes, metadata_path, parquet_path
from shard_cache.errors import CacheLockedError, ShardCacheError
from shard_cache.fs import get_fs, write_atomic
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


def _documents(task: ShardTask, processor: BatchProcessor, skipped: Counter[str], progress: list[int]) -> Iterator:
    done_bytes = 0
    # A record processor (shard_cache.records) makes each document from a whole record as it is read.
    prepare, fields = getattr(processor, "prepare", None), tuple(getattr(processor, "record_fields", ()))
    for url in task.files:
        reader = DocumentReader(
            url,
            task.fmt,
            task.text_field,
            task.on_bad_input,
            skipped,
            prepare,
            fields,  # type: ignore[arg-type]
        )
        for doc in reader:
            progress[0] = done_bytes + reader.bytes_read
            yield doc
        done_bytes += reader.bytes_read
        progress[0] = done_bytes


def _check_batch(batch: Any, docs: int, shard: int) -> pa.RecordBatch:
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
    yield from process_shard(task, _warm_processor[key])


def process_shard(task: ShardTask, processor: BatchProcessor) -> Iterator[dict[str, Any]]:
    """Yield one message per new chunk (written here, or carried as bytes), then a final `done` message."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the Ray workers are the parallelism
    fs, root = get_fs(task.cache_url)
    lock = BuildLock(fs=fs, root=root, token=task.lock_token)
    skipped: Counter[str] = Counter()
    progress = [0]
    chunk_index = 0
    docs: list[str] = []

    def emit(batch_docs: list[str]) -> dict[str, Any]:
        batch = _check_batch(processor(batch_docs), len(batch_docs), task.shard)
        data = encode_chunk(batch)
        meta = chunk_metadata(batch, data, skipped)
        message: dict[str, Any] = {"chunk": chunk_index, "meta": meta, "bytes_read": progress[0]}
        if task.worker_writes:
            if not lock.still_held():
                raise CacheLockedError(
                    f"{task.cache_url}: this build lost its lock to another builder; it stops without writing."
                )
            write_atomic(fs, parquet_path(root, task.shard, chunk_index), data)
            write_atomic(fs, metadata_path(root, task.shard, chunk_index), metadata_bytes(meta))
        else:
            message["data"] = data
        return message

    for doc in _documents(task, processor, skipped, progress):
        docs.append(doc)
        if len(docs) == task.chunk_size:
            if chunk_index >= task.start_chunk:
                yield emit(docs)
            chunk_index += 1
            docs = []
    if docs and chunk_index >= task.start_chunk:
        yield emit(docs)
    yield {"done": True, "skipped": dict(skipped), "bytes_read": progress[0]}
