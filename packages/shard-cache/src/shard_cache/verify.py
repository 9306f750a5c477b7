"""Inspect and verify a cache: a summary from the ledger, and the checksums of every committed chunk."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from shard_cache.chunks import metadata_path, parquet_path, token_counts
from shard_cache.errors import CacheCorruptError, ShardCacheError
from shard_cache.fs import get_fs, join, read_bytes
from shard_cache.ledger import LEDGER_NAME, SETTINGS_NAME, Ledger, global_order


def _load(cache_dir: str) -> tuple[Any, str, Ledger, dict[str, Any]]:
    fs, root = get_fs(cache_dir)
    try:
        ledger = Ledger.from_json(read_bytes(fs, join(root, LEDGER_NAME)), where=f"{cache_dir}/{LEDGER_NAME}")
        settings = json.loads(read_bytes(fs, join(root, SETTINGS_NAME)))
    except FileNotFoundError as exc:
        raise ShardCacheError(
            f"{cache_dir}: not a shard-cache cache (no {LEDGER_NAME} or {SETTINGS_NAME}). Check the path."
        ) from exc
    return fs, root, ledger, settings


def inspect_cache(cache_dir: str) -> dict[str, Any]:
    """A summary of a cache: state, shards, chunks, documents, tokens, skipped documents, settings."""
    _, _, ledger, settings = _load(cache_dir)
    skipped: dict[str, int] = {}
    for shard in ledger.shards:
        for reason, count in shard.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    return {
        "cache_dir": cache_dir,
        "finished": ledger.finished,
        "error": ledger.error,
        "shards": len(ledger.shards),
        "shards_done": sum(s.done for s in ledger.shards),
        "chunks": sum(len(s.chunks) for s in ledger.shards),
        "chunks_in_global_order": len(ledger.order),
        "docs": sum(c.docs for s in ledger.shards for c in s.chunks),
        "tokens": sum(c.tokens.get("input_ids", 0) for s in ledger.shards for c in s.chunks),
        "skipped": dict(sorted(skipped.items())),
        "chunk_size": settings.get("chunk_size"),
        "processor": settings.get("processor"),
    }


@dataclass
class VerifyReport:
    """Outcome of `verify_cache`: the chunks checked and one line per problem."""

    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_chunk(fs: Any, root: str, shard: int, chunk: int, docs: int, tokens: dict[str, int]) -> list[str]:
    data_path, meta_path = parquet_path(root, shard, chunk), metadata_path(root, shard, chunk)
    try:
        data = read_bytes(fs, data_path)
        meta = json.loads(read_bytes(fs, meta_path))
    except FileNotFoundError as exc:
        return [f"{exc.filename or exc}: missing"]
    except ValueError as exc:
        return [f"{meta_path}: not valid JSON ({exc})"]
    problems = []
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        problems.append(f"{data_path}: sha256 differs from {meta_path}")
    if len(data) != meta.get("bytes"):
        problems.append(f"{data_path}: {len(data)} bytes, metadata says {meta.get('bytes')}")
    try:
        table = pq.read_table(pa.BufferReader(data))
    except Exception as exc:
        return [*problems, f"{data_path}: not readable Parquet ({exc})"]
    if table.num_rows != docs or meta.get("docs") != docs:
        problems.append(f"{data_path}: {table.num_rows} documents, ledger says {docs}, metadata {meta.get('docs')}")
    counted = token_counts(table.combine_chunks().to_batches()[0]) if table.num_rows else {}
    if counted != tokens or meta.get("tokens") != tokens:
        problems.append(f"{data_path}: token counts {counted}, ledger says {tokens}, metadata {meta.get('tokens')}")
    return problems


def verify_cache(cache_dir: str, progress: bool = False) -> VerifyReport:
    """Check every committed chunk: present, checksum, size, documents and tokens agree with the ledger."""
    from tqdm.auto import tqdm

    fs, root, ledger, _ = _load(cache_dir)
    report = VerifyReport()
    committed = [(s, c, entry) for s, state in enumerate(ledger.shards) for c, entry in enumerate(state.chunks)]
    for shard, chunk, entry in tqdm(committed, desc="verify", unit="chunk", disable=not progress):
        report.problems.extend(_check_chunk(fs, root, shard, chunk, entry.docs, entry.tokens))
        report.chunks_checked += 1

    expected = global_order([len(s.chunks) for s in ledger.shards], [s.done for s in ledger.shards])
    if ledger.order != expected:
        report.problems.append(f"{cache_dir}/{LEDGER_NAME}: the global order is not the round-robin order")
    return report


def require_valid(cache_dir: str) -> VerifyReport:
    """verify_cache, raising CacheCorruptError listing the problems if there are any."""
    report = verify_cache(cache_dir)
    if not report.ok:
        raise CacheCorruptError(f"{cache_dir}: {len(report.problems)} problem(s): " + "; ".join(report.problems[:5]))
    return report
