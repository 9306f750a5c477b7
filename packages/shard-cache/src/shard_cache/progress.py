"""Build progress: a tqdm bar (input bytes, with rate and ETA; documents, tokens and shards alongside) and
the metrics callback that trackers use."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
from tqdm.auto import tqdm

from shard_cache.inputs import HF_PREFIX, Shard
from shard_cache.ledger import Ledger


@dataclass(frozen=True)
class BuildMetrics:
    """A snapshot of a build, handed to the metrics callback after each ledger commit."""

    docs: int
    tokens: int
    chunks: int
    shards_done: int
    shards_total: int
    skipped: int
    elapsed_s: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self, prefix: str = "cache/") -> dict[str, float]:
        """Flat metrics for a tracker, e.g. {"cache/docs": ..., "cache/tokens_per_second": ...}."""
        values = {
            "docs": self.docs,
            "tokens": self.tokens,
            "chunks": self.chunks,
            "shards_done": self.shards_done,
            "shards_total": self.shards_total,
            "skipped": self.skipped,
            "tokens_per_second": self.tokens_per_second,
        }
        return {prefix + key: float(value) for key, value in values.items()}


def _size(url: str) -> int | None:
    if url.startswith(HF_PREFIX):
        return None
    try:
        fs, path = fsspec.core.url_to_fs(url)
        return int(fs.size(path))
    except Exception:
        return None


class BuildProgress:
    """Keeps the running totals of a build, drives the bar, and calls the metrics callback."""

    def __init__(
        self,
        shards: list[Shard],
        ledger: Ledger,
        show: bool,
        callback: Callable[[BuildMetrics], None] | None,
        started: float,
    ):
        self.ledger = ledger
        self.callback = callback
        self.started = started
        sizes = [[_size(f) for f in s.files] for s in shards]
        self.shard_bytes = [sum(x or 0 for x in group) for group in sizes]
        known = all(x is not None for group in sizes for x in group)
        self.bytes_seen = [self.shard_bytes[i] if ledger.shards[i].done else 0 for i in range(len(shards))]
        self.bar: Any = tqdm(
            total=sum(self.shard_bytes) if known else None,
            initial=sum(self.bytes_seen),
            unit="B",
            unit_scale=True,
            desc="shard-cache build",
            disable=not show,
            dynamic_ncols=True,
        )

    def update(self, shard: int, message: dict[str, Any]) -> None:
        """Account for one worker message."""
        seen = int(message.get("bytes_read", 0))
        if message.get("done"):
            seen = max(seen, self.shard_bytes[shard])
        delta = seen - self.bytes_seen[shard]
        if delta > 0:
            self.bytes_seen[shard] = seen
            self.bar.update(delta)

    def metrics(self) -> BuildMetrics:
        states = self.ledger.shards
        return BuildMetrics(
            docs=sum(c.docs for s in states for c in s.chunks),
            tokens=sum(c.tokens.get("input_ids", 0) for s in states for c in s.chunks),
            chunks=sum(len(s.chunks) for s in states),
            shards_done=sum(s.done for s in states),
            shards_total=len(states),
            skipped=sum(sum(s.skipped.values()) for s in states),
            elapsed_s=time.monotonic() - self.started,
        )

    def report(self) -> None:
        """Refresh the bar's counters and call the metrics callback with the committed totals."""
        metrics = self.metrics()
        self.bar.set_postfix(
            docs=metrics.docs,
            tokens=metrics.tokens,
            shards=f"{metrics.shards_done}/{metrics.shards_total}",
            tok_s=f"{metrics.tokens_per_second:,.0f}",
            refresh=False,
        )
        if self.callback is not None:
            self.callback(metrics)

    def close(self) -> None:
        self.bar.close()
