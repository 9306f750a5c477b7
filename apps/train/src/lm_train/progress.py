"""A live progress line for training: step, loss, tokens/s, MFU and ETA."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainingProgress:
    """Shows one bar that advances every step; metrics refresh whenever they are logged."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self._fields = {"loss": "-", "tps": "-", "mfu": "-"}
        console = Console(file=sys.stderr)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  MFU {task.fields[mfu]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled,
            refresh_per_second=4,
            # Without a terminal, rich prints nothing until the end; refresh lines so logs show progress.
            redirect_stderr=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, **self._fields)
        self._last_print = time.monotonic()
        self._plain = enabled and not console.is_terminal

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def advance(self, step: int) -> None:
        self._progress.update(self._task, completed=step)

    def metrics(self, step: int, loss: float, tokens_per_second: float, mfu: float | None) -> None:
        self._fields = {
            "loss": f"{loss:.4f}",
            "tps": f"{tokens_per_second:,.0f}",
            "mfu": "-" if mfu is None else f"{100 * mfu:.1f}%",
        }
        self._progress.update(self._task, completed=step, **self._fields)
        if self._plain:
            task = self._progress.tasks[0]
            eta = task.time_remaining
            eta_text = f"{eta:.0f}s" if eta is not None else "-"
            print(
                f"step {step}/{task.total}  loss {self._fields['loss']}  {self._fields['tps']} tok/s  "
                f"MFU {self._fields['mfu']}  ETA {eta_text}",
                file=sys.stderr,
                flush=True,
            )

    def note(self, text: str) -> None:
        if self.enabled:
            self._progress.console.print(text)
