"""A tracker printing one concise line per step (and tables for hyperparameters and summary) with rich."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trackers.histogram import Histogram
from trackers.tracker import Tracker, raise_if_finished
from trackers.values import flatten_mapping, jsonable, plain_metrics, plain_step

_shared: Console | None = None


def share_console(console: Console | None) -> None:
    """Make console trackers without a console of their own print on `console` (an app's live display's), or
    on a fresh stdout console again with None: a second rich console would print into the live display."""
    global _shared
    _shared = console


def _format_number(value: int | float | bool, precision: int) -> str:
    if isinstance(value, bool | int):
        return str(value)
    return f"{value:.{precision}g}"


class ConsoleTracker(Tracker):
    """Prints `step N  name value  name value ...`; histograms and text are left out of the line."""

    def __init__(self, *, console: Console | None = None, precision: int = 4) -> None:
        self._console = console
        self._default = Console()
        self.precision = precision
        self._finished = False

    @property
    def console(self) -> Console:
        """Its own console if given, else the shared one if an app shares one, else stdout."""
        return self._console or _shared or self._default

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Print one line with the step and every scalar metric."""
        raise_if_finished(self, self._finished)
        line = Text()
        line.append(f"step {plain_step(step)}", style="bold")
        for key, value in plain_metrics(metrics).items():
            if isinstance(value, Histogram | str):
                continue
            line.append(f"  {key} ", style="dim")
            line.append(_format_number(value, self.precision))
        self.console.print(line, highlight=False, soft_wrap=True)

    def _print_table(self, title: str, values: Mapping[str, Any]) -> None:
        table = Table(title=title, show_header=False, title_justify="left")
        for key, value in flatten_mapping(jsonable(values)).items():
            shown = _format_number(value, self.precision) if isinstance(value, int | float) else str(value)
            table.add_row(key, shown)
        self.console.print(table)

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """Print the hyperparameters as a two-column table."""
        raise_if_finished(self, self._finished)
        self._print_table("hyperparameters", hyperparameters)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Print the summary as a two-column table."""
        raise_if_finished(self, self._finished)
        self._print_table("summary", summary)

    def log_artifact(self, path: str | Path, name: str | None = None, type: str = "file") -> None:
        """Print where the artifact is."""
        raise_if_finished(self, self._finished)
        self.console.print(f"artifact {name or Path(path).name} ({type}): {path}", highlight=False)

    def finish(self) -> None:
        """Nothing to close; later calls are refused."""
        self._finished = True
