"""The run's one console: a single live display for the cache bars and the training bar, plain lines elsewhere."""

from __future__ import annotations

import sys
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task
from rich.table import Column
from rich.text import Text

import trackers.console

_current: RunConsole | None = None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    return (
        f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
        if whole >= 3600
        else f"{whole // 60}:{whole % 60:02d}"
    )


def fit_parts(parts: list[tuple[str, int]], width: int, separator: str = "  ") -> str:
    """Join the (text, rank) parts, leaving out the highest ranks first until the line fits `width` columns;
    rank 0 always stays, cut with `…` if even it is too wide."""
    kept = list(parts)
    while cell_len(separator.join(t for t, _ in kept)) > width and any(rank > 0 for _, rank in kept):
        worst = max(rank for _, rank in kept)
        index = max(i for i, (_, rank) in enumerate(kept) if rank == worst)
        del kept[index]
    line = separator.join(t for t, _ in kept)
    return line if cell_len(line) <= width else line[: max(width - 1, 0)] + "…"


class _LineColumn(ProgressColumn):
    """Each task as one line that fits the terminal: what it does, its figures, a bar, elapsed time and ETA,
    the least needed left out first (rich would cut the line, or wrap it, instead)."""

    def __init__(self, console: Console):
        super().__init__(table_column=Column(no_wrap=True, overflow="crop"))
        self.console = console

    def render(self, task: Task) -> Text:
        eta = task.fields["eta"] if "eta" in task.fields else _duration(task.time_remaining)
        width = self.console.width - 1  # the last column stays empty: some terminals wrap on it
        # Training hands its figures as ranked parts; the cache builds' shard-cache hands one `stats` text, cut
        # to the room beside the description and ETA rather than left out whole.
        room = width - cell_len(task.description) - cell_len(f"ETA {eta}") - 4
        figures = task.fields.get("parts") or [(fit_parts([(task.fields.get("stats", ""), 0)], room), 2)]
        bar = self._bar(task, 20)
        parts = [(task.description, 0), (bar, 4), *[(t, rank) for t, rank in figures if t]]
        parts += [(_duration(task.finished_time or task.elapsed), 5), (f"ETA {eta}", 1)]
        line = fit_parts(parts, width)
        text = Text(line)
        text.stylize("bold", 0, min(len(task.description), len(line)))
        if bar in line:
            start = line.index(bar)
            done = bar.count("━")
            text.stylize("green", start, start + done)
            text.stylize("bright_black", start + done, start + len(bar))
        return text

    @staticmethod
    def _bar(task: Task, width: int) -> str:
        total = task.total or 0
        done = 0 if not total else min(width, round(width * task.completed / total))
        return "━" * done + "╌" * (width - done)


class RunConsole:
    """One rich Progress on stderr, live on a terminal; while it runs, every print goes above it, never into it.

    The live display takes over sys.stdout and sys.stderr (rich's redirection), so tracker lines, tables and
    notes from any module print as whole lines above the bars. Without a terminal nothing is live: the cache
    builds log plain lines and the training bar prints one line per logged step.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.console = Console(file=sys.stderr)
        self.live = enabled and self.console.is_terminal and not self.console.is_dumb_terminal
        self.progress = Progress(
            _LineColumn(self.console),
            console=self.console,
            expand=False,
            disable=not self.live,
            refresh_per_second=4,
            redirect_stdout=True,
            redirect_stderr=True,
        )

    def cache_display(self) -> Any:
        """What shard-cache's `progress=` takes: our live Progress (a task of its own in it), plain lines, or off."""
        if not self.enabled:
            return False
        return self.progress if self.live else True

    def __enter__(self) -> RunConsole:
        global _current
        if self.live:
            self.progress.start()
            trackers.console.share_console(self.console)
        _current = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _current
        _current = None
        if self.live:
            trackers.console.share_console(None)
            self.progress.stop()


def current_console() -> RunConsole | None:
    """The run's console while `train` holds one."""
    return _current


__all__ = ["RunConsole", "current_console", "fit_parts"]
