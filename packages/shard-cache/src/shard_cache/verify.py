"""Inspect and verify a cache: a summary from the ledger, and the checksums and counts of every committed chunk."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shard_cache.chunks import crc32c, decode_chunk, metadata_path, parquet_path, sha256, token_counts
from shard_cache.errors import CacheCorruptError, ShardCacheError
from shard_cache.fs import get_fs, join, read_bytes
from shard_cache.ledger import LEDGER_NAME, SETTINGS_NAME, ChunkEntry, Ledger, global_order
from shard_cache.progress import open_display


def load_settings(fs: Any, root: str, url: str) -> dict[str, Any]:
    """The cache's cache.json (its build settings and input shards)."""
    path = join(root, SETTINGS_NAME)
    try:
        settings = json.loads(read_bytes(fs, path))
    except FileNotFoundError as exc:
        raise ShardCacheError(f"{url}: not a shard-cache cache (no {SETTINGS_NAME} there). Check the path.") from exc
    except ValueError as exc:
        raise CacheCorruptError(
            f"{url}/{SETTINGS_NAME}: damaged ({exc}). It records how the cache was built; without it the chunks "
            "cannot be trusted: rebuild the cache into a new directory."
        ) from exc
    if not isinstance(settings, dict):
        raise CacheCorruptError(f"{url}/{SETTINGS_NAME}: damaged (not a JSON object); rebuild into a new directory.")
    return settings


def load_ledger(fs: Any, root: str, url: str) -> Ledger:
    """The cache's ledger; CacheCorruptError (with the fix) when it is damaged."""
    try:
        return Ledger.from_json(read_bytes(fs, join(root, LEDGER_NAME)), where=f"{url}/{LEDGER_NAME}")
    except FileNotFoundError as exc:
        raise ShardCacheError(
            f"{url}: not a shard-cache cache, or its ledger is gone (no {LEDGER_NAME} there). Check the path; if it "
            "is a cache, run its `shard-cache build` command again to rebuild the ledger from the chunk files."
        ) from exc


def _load(cache_dir: str) -> tuple[Any, str, Ledger, dict[str, Any]]:
    fs, root = get_fs(cache_dir)
    settings = load_settings(fs, root, cache_dir)
    return fs, root, load_ledger(fs, root, cache_dir), settings


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
        "empty_inputs": [f for s in ledger.shards for f in s.empty_files],
        "chunk_checksums": "crc32c" if all(c.crc32c for s in ledger.shards for c in s.chunks) else "sha256 only",
        "chunk_size": settings.get("chunk_size"),
        "processor": settings.get("processor"),
    }


@dataclass
class VerifyReport:
    """Outcome of `verify_cache`: the chunks checked, one line per problem, and the damaged (shard, chunk)s."""

    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)
    damaged: list[tuple[int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def chunk_problems(fs: Any, root: str, shard: int, chunk: int, entry: ChunkEntry) -> list[str]:
    """What is wrong with one committed chunk (empty when nothing): files, checksums, counts."""
    data_path, meta_path = parquet_path(root, shard, chunk), metadata_path(root, shard, chunk)
    problems = []
    try:
        data = read_bytes(fs, data_path)
    except FileNotFoundError:
        return [f"{data_path}: missing"]
    except ShardCacheError as exc:
        return [str(exc)]
    if entry.crc32c is not None and crc32c(data) != entry.crc32c:
        problems.append(f"{data_path}: its CRC-32C differs from the ledger's (the file is damaged)")
    try:
        meta = json.loads(read_bytes(fs, meta_path))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return [*problems, f"{meta_path}: missing"]
    except ShardCacheError as exc:
        return [*problems, str(exc)]
    except ValueError as exc:
        return [*problems, f"{meta_path}: not valid JSON ({exc})"]
    if sha256(data) != meta.get("sha256"):
        problems.append(f"{data_path}: sha256 differs from {meta_path}")
    if len(data) != meta.get("bytes"):
        problems.append(f"{data_path}: {len(data)} bytes, metadata says {meta.get('bytes')}")
    try:
        table = decode_chunk(data)
    except Exception as exc:
        return [*problems, f"{data_path}: not readable Parquet ({exc})"]
    if table.num_rows != entry.docs or meta.get("docs") != entry.docs:
        problems.append(
            f"{data_path}: {table.num_rows} documents, ledger says {entry.docs}, metadata {meta.get('docs')}"
        )
    counted = token_counts(table) if table.num_rows else {}
    if counted != entry.tokens or meta.get("tokens") != entry.tokens:
        problems.append(
            f"{data_path}: token counts {counted}, ledger says {entry.tokens}, metadata {meta.get('tokens')}"
        )
    return problems


def verify_cache(cache_dir: str, progress: Any = False) -> VerifyReport:
    """Check every committed chunk: present, checksums, size, documents and tokens agree with the ledger.

    A damaged ledger is reported as a problem (not raised); `progress` is as for `build_cache`.
    """
    fs, root = get_fs(cache_dir)
    load_settings(fs, root, cache_dir)
    report = VerifyReport()
    try:
        ledger = load_ledger(fs, root, cache_dir)
    except CacheCorruptError as exc:
        report.problems.append(str(exc))
        return report
    committed = [(s, c, entry) for s, state in enumerate(ledger.shards) for c, entry in enumerate(state.chunks)]
    display = open_display(progress, "verify", float(len(committed)) or None, unit="chunk")
    try:
        for shard, chunk, entry in committed:
            problems = chunk_problems(fs, root, shard, chunk, entry)
            if problems:
                report.problems.extend(problems)
                report.damaged.append((shard, chunk))
            report.chunks_checked += 1
            display.update(report.chunks_checked, f"{report.chunks_checked}/{len(committed)} chunks")
    finally:
        display.close(finished=True)
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
