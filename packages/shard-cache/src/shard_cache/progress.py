"""Progress of long work: a rich bar on a terminal, plain one-line logs elsewhere, and the build's metrics.

`progress=` of `build_cache` and `verify_cache` takes True (a bar on stderr when it is a terminal, else a line
every few seconds), False (nothing), a `rich.console.Console` (the same, on that console), or a
`rich.progress.Progress` that the caller owns and has started: the work then adds its own task to it and never
starts or stops it, so an app can show cache bars and its training bar in one live display. The task's
`stats` field holds the counts as text ("2/8 shards · 12,345 docs · ..."), for the caller's columns.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from shard_cache.inputs import HF_PREFIX, Shard
from shard_cache.ledger import Ledger

LINE_INTERVAL_S = 5.0  # plain logs: at most one line this often, and the last one at the end


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
    tokens_at_start: int = 0  # committed by earlier runs of a resumed build: not part of this run's rate
    bytes_done: int = 0
    bytes_total: int | None = None  # input bytes, when every input's size is known
    nodes: int = 0  # Ray nodes that have finished shards in this run of the build (a cluster's hosts at work)

    @property
    def shards_finished(self) -> int:
        return self.shards_done

    @property
    def tokens_per_second(self) -> float:
        """Tokens committed per second by this run of the build."""
        return (self.tokens - self.tokens_at_start) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self, prefix: str = "preprocessing/") -> dict[str, float]:
        """Flat metrics for a tracker: preprocessing/docs, /tokens, /shards_finished, /tokens_per_second, ..."""
        values = {
            "docs": self.docs,
            "tokens": self.tokens,
            "shards_finished": self.shards_done,
            "shards_total": self.shards_total,
            "chunks": self.chunks,
            "skipped": self.skipped,
            "tokens_per_second": self.tokens_per_second,
            "nodes": self.nodes,
        }
        return {prefix + key: float(value) for key, value in values.items()}

    def summary(self) -> str:
        """The counts as one short line of text."""
        parts = [
            f"{self.shards_done}/{self.shards_total} shards",
            f"{self.docs:,} docs",
            f"{self.tokens:,} tokens",
            f"{_si(self.tokens_per_second)} tokens/s",
        ]
        if self.skipped:
            parts.append(f"{self.skipped:,} skipped")
        if self.nodes > 1:
            parts.append(f"{self.nodes} nodes")
        return " · ".join(parts)


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _NoDisplay:
    def update(self, completed: float, text: str) -> None:
        pass

    def note(self, text: str) -> None:
        logging.getLogger("shard_cache").warning(text)

    def close(self, finished: bool) -> None:
        pass


class _LineDisplay:
    """Plain one-line logs for a stream that is not a terminal: rate-limited, never the same line twice."""

    def __init__(self, write: Callable[[str], None], label: str, total: float | None):
        self.write, self.label, self.total = write, label, total
        self.started = time.monotonic()
        self.completed = 0.0
        self.first_completed: float | None = None
        self.text = ""
        self.last_line = ""
        self.last_time = -LINE_INTERVAL_S

    def _line(self) -> str:
        parts = [self.text] if self.text else []
        if self.total:
            parts.insert(0, f"{min(100.0, 100.0 * self.completed / self.total):.0f}%")
            done_now = self.completed - (self.first_completed or 0.0)
            elapsed = time.monotonic() - self.started
            if done_now > 0 and self.completed < self.total:
                parts.append(f"ETA {_clock(elapsed * (self.total - self.completed) / done_now)}")
        return f"{self.label}: " + " · ".join(parts)

    def _emit(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self.last_time < LINE_INTERVAL_S:
            return
        line = self._line()
        if line != self.last_line:
            self.write(line)
            self.last_line, self.last_time = line, now

    def update(self, completed: float, text: str) -> None:
        if self.first_completed is None:
            self.first_completed = completed
        self.completed, self.text = completed, text
        self._emit(force=False)

    def note(self, text: str) -> None:
        self.write(f"note: {text}")

    def close(self, finished: bool) -> None:
        if finished and self.total:
            self.completed = self.total
        self._emit(force=True)


class _RichDisplay:
    """A task on a rich Progress: ours (started and stopped here) or the caller's (only the task is ours)."""

    def __init__(self, progress: Any, owned: bool, label: str, total: float | None, unit: str):
        self.progress, self.owned = progress, owned
        if owned:
            progress.start()
        self.task = progress.add_task(label, total=total, stats="", unit=unit)
        self.total = total

    def update(self, completed: float, text: str) -> None:
        self.progress.update(self.task, completed=completed, stats=text)

    def note(self, text: str) -> None:
        self.progress.console.print(f"note: {text}", markup=False, highlight=False)

    def close(self, finished: bool) -> None:
        if finished:
            total = self.total or 1
            self.progress.update(self.task, total=total, completed=total)
        if self.owned:
            self.progress.stop()
        else:
            self.progress.refresh()


def _rich_progress(console: Any) -> Any:
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
        console=console,
        refresh_per_second=4,
        # Leave sys.stdout/sys.stderr alone: a build may run in a background thread beside another live display,
        # and a second Live that swaps the global streams would restore the wrong ones when it stops.
        redirect_stdout=False,
        redirect_stderr=False,
    )


def open_display(target: Any, label: str, total: float | None, unit: str = "B") -> Any:
    """The display for `target` (True, False, a rich Console or a started rich Progress); see the module doc."""
    if target is False or target is None:
        return _NoDisplay()
    from rich.console import Console
    from rich.progress import Progress

    if isinstance(target, Progress):
        return _RichDisplay(target, owned=False, label=label, total=total, unit=unit)
    console = target if isinstance(target, Console) else Console(stderr=True)
    if console.is_terminal and not console.is_dumb_terminal:
        return _RichDisplay(_rich_progress(console), owned=True, label=label, total=total, unit=unit)
    if isinstance(target, Console):
        return _LineDisplay(lambda line: console.print(line, markup=False, highlight=False), label, total)
    return _LineDisplay(_stderr_line, label, total)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def input_size(url: str) -> int | None:
    """The size in bytes of an input file (local or remote), or None where it is unknown (hf:, unreachable)."""
    if url.startswith(HF_PREFIX):
        return None
    try:
        fs, path = fsspec.core.url_to_fs(url)
        return int(fs.size(path))
    except Exception:
        return None


class BuildProgress:
    """Keeps the running totals of a build, drives its display, and calls the metrics callback."""

    def __init__(
        self,
        shards: list[Shard],
        ledger: Ledger,
        show: Any,
        callback: Callable[[BuildMetrics], None] | None,
        started: float,
        label: str = "shard-cache build",
        sizes: list[list[int | None]] | None = None,
    ):
        self.ledger = ledger
        self.callback = callback
        self.started = started
        if sizes is None:  # each shard's files' sizes, when the caller has not looked them up already
            sizes = [[input_size(f) for f in s.files] for s in shards]
        self.shard_bytes = [sum(x or 0 for x in group) for group in sizes]
        known = all(x is not None for group in sizes for x in group)
        # No total for unknown sizes, nor for inputs that are all empty: a bar of 0 bytes would mean nothing.
        self.bytes_total = sum(self.shard_bytes) if known and sum(self.shard_bytes) > 0 else None
        self.bytes_seen = [self.shard_bytes[i] if ledger.shards[i].done else 0 for i in range(len(shards))]
        self.tokens_at_start = self._committed_tokens()
        self.nodes: set[str] = set()
        self.display = open_display(show, label, self.bytes_total)
        self.display.update(sum(self.bytes_seen), self.metrics().summary())

    def _committed_tokens(self) -> int:
        return sum(c.tokens.get("input_ids", 0) for s in self.ledger.shards for c in s.chunks)

    def update(self, shard: int, message: dict[str, Any]) -> None:
        """Account for one worker message."""
        seen = int(message.get("bytes_read", 0))
        if message.get("done"):
            seen = max(seen, self.shard_bytes[shard])
            if message.get("node"):
                self.nodes.add(message["node"])
        if seen > self.bytes_seen[shard]:
            self.bytes_seen[shard] = seen

    def note(self, text: str) -> None:
        """Print one line beside the bar (an empty input file, a recovered ledger)."""
        self.display.note(text)

    def metrics(self) -> BuildMetrics:
        states = self.ledger.shards
        return BuildMetrics(
            docs=sum(c.docs for s in states for c in s.chunks),
            tokens=self._committed_tokens(),
            chunks=sum(len(s.chunks) for s in states),
            shards_done=sum(s.done for s in states),
            shards_total=len(states),
            skipped=sum(sum(s.skipped.values()) for s in states),
            elapsed_s=time.monotonic() - self.started,
            tokens_at_start=self.tokens_at_start,
            bytes_done=sum(self.bytes_seen),
            bytes_total=self.bytes_total,
            nodes=len(self.nodes),
        )

    def report(self) -> None:
        """Refresh the display and call the metrics callback with the committed totals."""
        metrics = self.metrics()
        self.display.update(metrics.bytes_done, metrics.summary())
        if self.callback is not None:
            self.callback(metrics)

    def close(self) -> None:
        metrics = self.metrics()
        self.display.update(metrics.bytes_done, metrics.summary())
        self.display.close(finished=self.ledger.finished)
