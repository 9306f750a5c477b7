"""Rebuild damaged chunks from their source shards, byte for byte, or say why that cannot be done.

A chunk is a pure function of its shard's input files, the processor and the build settings, so it can be
made again. The new bytes are written only when their CRC-32C (or, for ledgers before 0.3, their sha256)
equals what the ledger recorded: a repair never changes what a reader sees, so it needs no lock and may run
beside a live build. A source that is gone or changed is an error naming the chunk and the source.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shard_cache.chunks import chunk_metadata, crc32c, encode_chunk, metadata_bytes, metadata_path, parquet_path, sha256
from shard_cache.damage import damaged_chunk_error, shard_sources, sources_present
from shard_cache.errors import CacheMismatchError, ChunkCorruptError, ShardCacheError
from shard_cache.fs import get_fs, read_bytes, write_atomic
from shard_cache.ledger import Ledger
from shard_cache.processor import BatchProcessor, TokenizerProcessor, load_tokenizer
from shard_cache.verify import load_ledger, load_settings, verify_cache
from shard_cache.worker import ShardReading, check_batch, iter_shard_chunks

REBUILDABLE_KINDS = ("tokenizer", "prompt_completion", "chat", "preference", "preference_chat", "prompt")


def _rebuilt_processor(wanted: dict[str, Any], tokenizer: Any, chat_template: str | None) -> BatchProcessor:
    """The processor that the fingerprint `wanted` describes, made from the cache's tokenizer."""
    kind = wanted.get("kind")
    if kind in ("preference", "preference_chat"):  # DPO's pairs (shard_cache.preferences)
        from shard_cache.preference_records import processor_from_fingerprint

        return processor_from_fingerprint(wanted, tokenizer, chat_template)
    if kind == "prompt":  # RL's prompt records (shard_cache.prompt_records)
        from shard_cache.prompt_records import processor_from_fingerprint as prompt_processor

        return prompt_processor(wanted, str(tokenizer), chat_template)
    if kind == "chat":  # the template comes from the tokenizer directory, or chat_template=
        from datetime import datetime

        from shard_cache.chat import ChatProcessor

        return ChatProcessor(
            tokenizer,
            chat_template=chat_template,
            messages_field=wanted["messages_field"],
            mask_user_turns=wanted["mask_user_turns"],
            roles=wanted["roles"],
            special_tokens=wanted["special_tokens"],
            template_variables=wanted["template_variables"],
            now=datetime.fromisoformat(wanted["now"]) if "now" in wanted else None,
        )
    loaded = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    eos = loaded.id_to_token(wanted["eos_id"]) if wanted.get("eos_id") is not None else None
    bos = loaded.id_to_token(wanted["bos_id"]) if wanted.get("bos_id") is not None else None
    if kind == "prompt_completion":
        from shard_cache.records import PromptCompletionProcessor

        prompt_field, completion_field = wanted["fields"]
        return PromptCompletionProcessor(
            loaded,
            prompt_field=prompt_field,
            completion_field=completion_field,
            mask_prompt=wanted["mask_prompt"],
            eos_token=eos,
            bos_token=bos,
            add_bos=bos is not None,
        )
    enforce_eos = wanted.get("enforce_eos", True)
    return TokenizerProcessor(loaded, eos_token=eos, bos_token=bos, add_bos=bos is not None, enforce_eos=enforce_eos)


def processor_for_cache(
    settings: dict[str, Any], tokenizer: Any = None, processor: Any = None, chat_template: str | None = None
) -> BatchProcessor:
    """A processor that makes this cache's chunks: the one given, or one rebuilt from `tokenizer` (and, for a
    chat cache whose tokenizer directory lacks it, `chat_template`), checked against the cache's fingerprint."""
    wanted = settings.get("processor")
    if processor is None:
        if tokenizer is None:
            raise ShardCacheError("repairing chunks needs the cache's tokenizer: pass tokenizer= (CLI: --tokenizer).")
        if not isinstance(wanted, dict) or wanted.get("kind") not in REBUILDABLE_KINDS:
            raise ShardCacheError(
                "this cache was built with a custom processor; pass that processor (processor=) to repair it."
            )
        processor = _rebuilt_processor(wanted, tokenizer, chat_template)
    if processor.fingerprint() != wanted:
        raise CacheMismatchError(
            f"the tokenizer/processor given is not the one this cache was built with (cache: {wanted}, given: "
            f"{processor.fingerprint()}). Pass the cache's own tokenizer (and, for a chat cache, its chat template)."
        )
    return processor


def _expected(fs: Any, root: str, ledger: Ledger, shard: int, chunk: int) -> tuple[str, str] | None:
    """('crc32c' | 'sha256', value) that the rebuilt bytes must match."""
    entry = ledger.shards[shard].chunks[chunk]
    if entry.crc32c is not None:
        return "crc32c", entry.crc32c
    try:  # a ledger from before 0.3: the metadata JSON's sha256, if that file is intact
        return "sha256", str(json.loads(read_bytes(fs, metadata_path(root, shard, chunk)))["sha256"])
    except (FileNotFoundError, ValueError, KeyError, TypeError, ShardCacheError):
        return None


def repair_chunks(cache_dir: str, targets: list[tuple[int, int]], processor: BatchProcessor) -> list[str]:
    """Rebuild the chunks `targets` ((shard, chunk) pairs) from their sources; returns the paths rewritten."""
    fs, root = get_fs(cache_dir)
    settings = load_settings(fs, root, cache_dir)
    ledger = load_ledger(fs, root, cache_dir)
    written: list[str] = []
    by_shard: dict[int, set[int]] = {}
    for shard, chunk in targets:
        by_shard.setdefault(shard, set()).add(chunk)
    for shard, wanted in sorted(by_shard.items()):
        sources = shard_sources(settings, shard)
        if not sources_present(sources):
            raise damaged_chunk_error(cache_dir, fs, root, shard, min(wanted), "found by a check")
        reading = ShardReading()
        chunks = iter_shard_chunks(
            sources,
            settings.get("input_format", "auto"),
            settings.get("text_field", "text"),
            settings.get("on_bad_input", "fail"),
            int(settings["chunk_size"]),
            reading,
            processor=processor,
        )
        for index, docs in chunks:
            if index > max(wanted):
                break
            if index not in wanted:
                continue
            batch = check_batch(processor(docs), len(docs), shard)
            data = encode_chunk(batch)
            expected = _expected(fs, root, ledger, shard, index)
            got = crc32c(data) if expected and expected[0] == "crc32c" else sha256(data)
            if expected is None or got != expected[1]:
                raise ChunkCorruptError(
                    f"{parquet_path(root, shard, index)}: rebuilt from {', '.join(sources)}, it does not match "
                    "what the ledger recorded, so the source changed since the build (or the ledger has no "
                    "checksum for it). It was left as it is: rebuild the cache from the inputs.",
                    path=parquet_path(root, shard, index),
                    shard=shard,
                    chunk=index,
                    sources=sources,
                    source_present=True,
                )
            write_atomic(fs, parquet_path(root, shard, index), data)
            write_atomic(
                fs, metadata_path(root, shard, index), metadata_bytes(chunk_metadata(batch, data, reading.skipped))
            )
            written.append(parquet_path(root, shard, index))
    return written


def chunk_repairer(cache_dir: str, repair_with: Any) -> Callable[[int, int], None]:
    """A function (shard, chunk) -> None that rebuilds one damaged chunk of `cache_dir` in place, from
    `repair_with`: the cache's tokenizer, a path to it, or its processor (checked against the cache on first use)."""
    made: list[BatchProcessor] = []

    def repair(shard: int, chunk: int) -> None:
        if not made:
            is_processor = callable(repair_with) and hasattr(repair_with, "fingerprint")
            fs, root = get_fs(cache_dir)
            made.append(
                processor_for_cache(
                    load_settings(fs, root, cache_dir),
                    tokenizer=None if is_processor else repair_with,
                    processor=repair_with if is_processor else None,
                )
            )
        repair_chunks(cache_dir, [(shard, chunk)], made[0])

    return repair


@dataclass
class RepairReport:
    """Outcome of `repair_cache`: what verify found, and the chunk files rewritten."""

    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    chunks_checked: int = 0

    @property
    def ok(self) -> bool:
        """True when the cache verifies after the repair."""
        return not self.problems


def repair_cache(
    cache_dir: str,
    *,
    tokenizer: Any = None,
    processor: Any = None,
    chat_template: str | None = None,
    progress: Any = False,
) -> RepairReport:
    """Verify every chunk and rebuild the damaged ones from their sources; `problems` lists what is left.

    The processor is `processor`, or the cache's own rebuilt from `tokenizer` (and `chat_template`, for a chat
    cache whose tokenizer directory does not hold its template)."""
    report = verify_cache(cache_dir, progress=progress)
    if report.ok or not report.damaged:
        return RepairReport(problems=list(report.problems), chunks_checked=report.chunks_checked)
    fs, root = get_fs(cache_dir)
    chosen = processor_for_cache(load_settings(fs, root, cache_dir), tokenizer, processor, chat_template)
    repaired = repair_chunks(cache_dir, report.damaged, chosen)
    after = verify_cache(cache_dir)
    return RepairReport(problems=list(after.problems), repaired=repaired, chunks_checked=after.chunks_checked)
