"""The run's one console: a single live display for the cache bars and the training bar, plain lines elsewhere."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

import trackers.console

_current: RunConsole | None = None


class _EtaColumn(ProgressColumn):
    """The task's own `eta` field (training measures it from step times), else rich's estimate (cache builds)."""

    def render(self, task: Task) -> Text:
        if "eta" in task.fields:
            return Text(f"ETA {task.fields['eta']}")
        remaining = task.time_remaining
        return Text("ETA -" if remaining is None else f"ETA {int(remaining) // 60}:{int(remaining) % 60:02d}")


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
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            _EtaColumn(),
            console=self.console,
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


__all__ = ["RunConsole", "current_console"]
