"""A live progress line for training: step, loss, tokens/s, MFU and ETA."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class TrainingProgress:
    """Shows one bar that advances every step; metrics refresh whenever they are logged."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self._fields = {"loss": "-", "tps": "-", "mfu": "-", "eta": "-"}
        self.total_steps = total_steps
        console = Console(file=sys.stderr)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  MFU {task.fields[mfu]}"),
            TimeElapsedColumn(),
            # Our own ETA from measured step times: jax dispatches steps asynchronously, so the bar itself can
            # run ahead of the computation and a rate taken from its advances would be wrong.
            TextColumn("ETA {task.fields[eta]}"),
            console=console,
            disable=not enabled,
            refresh_per_second=4,
            # Without a terminal, rich prints nothing until the end; refresh lines so logs show progress.
            redirect_stderr=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, **self._fields)
        self._plain = enabled and not console.is_terminal

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def advance(self, step: int) -> None:
        self._progress.update(self._task, completed=step)

    def metrics(
        self, step: int, loss: float, tokens_per_second: float, mfu: float | None, seconds_per_step: float
    ) -> None:
        """Show logged metrics; the ETA is the remaining steps at the measured time per step."""
        self._fields = {
            "loss": f"{loss:.4f}",
            "tps": f"{tokens_per_second:,.0f}",
            "mfu": "-" if mfu is None else f"{100 * mfu:.1f}%",
            "eta": format_duration(max(0, self.total_steps - step) * seconds_per_step),
        }
        self._progress.update(self._task, completed=step, **self._fields)
        if self._plain:
            print(
                f"step {step}/{self.total_steps}  loss {self._fields['loss']}  {self._fields['tps']} tok/s  "
                f"MFU {self._fields['mfu']}  ETA {self._fields['eta']}",
                file=sys.stderr,
                flush=True,
            )

    def note(self, text: str) -> None:
        if self.enabled:
            self._progress.console.print(text, soft_wrap=True)  # paths and commands stay whole, to copy
