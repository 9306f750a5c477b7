"""Examples of whole documents, as `data.pack` says, and a summary of what the data left out.

- packed: several documents per sequence (shard_cache.PackedSequences): `input_ids`, `segment_ids`,
  `positions` restarting at each document, and `loss_mask`; attention stays inside a document;
- padded: one document per row (`PaddedRows`): `input_ids` and `loss_mask` only, since causal attention
  over a row whose padding comes last needs no segment ids;
- otherwise (plain text, not packed): windows of seq_len tokens over the concatenated documents.

A document longer than seq_len follows `data.long_documents` (truncate: its first seq_len tokens; split;
drop), and the counts are reported with the bad records that were skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import shard_cache
from shard_cache import CacheReader, PackedSequences

from lm_train.config.data_config import DataConfig

PACKED_FIELDS = ("input_ids", "segment_ids", "positions", "loss_mask")
PADDED_FIELDS = ("input_ids", "loss_mask")
WINDOW_FIELDS = ("input_ids",)

ExampleView = Callable[[CacheReader, int], Any]
"""(cache reader, seq_len) -> the examples of that cache (TokenWindows, PackedSequences or PaddedRows)."""


class PaddedRows(PackedSequences):
    """One document per row, padded after its end: `input_ids` and `loss_mask` per example."""

    def __init__(self, reader: CacheReader, seq_len: int, *, long_documents: str = "truncate", pad_id: int = 0):
        super().__init__(reader, seq_len, long_documents=long_documents, max_segments=1, pad_id=pad_id)

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> dict[str, np.ndarray]:
        full = super().get_batch(indices, timeout)
        return {name: full[name] for name in PADDED_FIELDS}


def token_windows(reader: CacheReader, seq_len: int) -> Any:
    """Consecutive windows of seq_len tokens (pretraining on plain text)."""
    return reader.token_windows(seq_len)


def example_view(config: DataConfig) -> ExampleView:
    """How a cache of this data becomes examples: packed, padded or token windows."""
    if not config.whole_documents:
        return token_windows
    rule = config.long_document_rule
    if config.packed:
        return lambda reader, seq_len: PackedSequences(reader, seq_len, long_documents=rule)
    return lambda reader, seq_len: PaddedRows(reader, seq_len, long_documents=rule)


def example_fields(config: DataConfig) -> tuple[str, ...]:
    """The batch fields this data's examples have (the train step is compiled for them)."""
    if not config.whole_documents:
        return WINDOW_FIELDS
    return PACKED_FIELDS if config.packed else PADDED_FIELDS


@dataclass(frozen=True)
class DataSummary:
    """What the training data held and left out: metrics for the trackers and one line for the console."""

    metrics: dict[str, float]
    text: str


def _skipped(cache_dir: str) -> dict[str, int]:
    try:
        return dict(shard_cache.inspect_cache(cache_dir)["skipped"])
    except shard_cache.ShardCacheError:
        return {}


def data_summary(view: Any, cache_dir: str, *, finished: bool) -> DataSummary | None:
    """Bad records skipped (by reason) and, for whole documents, how they were packed, truncated or dropped.

    None when there is nothing to say (token windows of a cache that skipped nothing).
    """
    skipped = _skipped(cache_dir)
    metrics: dict[str, float] = {}
    parts = []
    if isinstance(view, PackedSequences):
        view.num_examples_available()  # plans every committed chunk, so the counts cover them all
        stats = view.stats()
        capacity = stats.sequences * view.seq_len
        metrics.update(
            {
                "data/documents": stats.documents,
                "data/sequences": stats.sequences,
                "data/truncated_documents": stats.truncated_documents,
                "data/truncated_tokens": stats.truncated_tokens,
                "data/dropped_documents": stats.dropped_documents,
                "data/fill": stats.tokens / capacity if capacity else 0.0,
            }
        )
        parts.append(
            f"{stats.documents} documents in {stats.sequences} sequences of {view.seq_len} tokens "
            f"({metrics['data/fill']:.0%} filled)"
        )
        if stats.truncated_documents:
            parts.append(
                f"{stats.truncated_documents} longer than {view.seq_len} tokens truncated to their first "
                f"{view.seq_len} ({stats.truncated_tokens} tokens cut)"
            )
        if stats.dropped_documents:
            parts.append(f"{stats.dropped_documents} longer than {view.seq_len} tokens dropped")
    if skipped:
        metrics["data/skipped_records"] = sum(skipped.values())
        metrics.update({f"data/skipped/{reason}": count for reason, count in skipped.items()})
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(skipped.items()))
        parts.append(f"{sum(skipped.values())} bad records skipped ({reasons})")
    if not parts:
        return None
    scope = "" if finished else " (so far: the cache is still being built)"
    return DataSummary(metrics, "training data" + scope + ": " + "; ".join(parts) + ".")
