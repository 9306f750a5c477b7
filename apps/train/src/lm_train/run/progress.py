"""The training bar and the compact line of each logged step: step, loss, lr, grad norm, tokens/s, MFU, ETA."""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from lm_train.run.console import RunConsole, current_console, fit_parts


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def plain_number(value: float, digits: int = 3) -> str:
    """`0.0003`, `0.000123`, `0.561`, `12.3`: significant digits without an exponent, as people read a rate."""
    if not np.isfinite(value):
        return str(value)
    return np.format_float_positional(value, precision=digits, unique=False, fractional=False, trim="-")


def tokens_per_second_text(value: float) -> str:
    """`950`, `3,257`, `12.3k`, `1.23M` tokens per second."""
    if value < 10_000:
        return f"{value:,.0f}"
    return f"{value / 1e3:.3g}k" if value < 1e6 else f"{value / 1e6:.3g}M"


def step_parts(
    step: int,
    total: int,
    loss: float,
    *,
    learning_rate: float | None = None,
    grad_norm: float | None = None,
    tokens_per_second: float | None = None,
    mfu: float | None = None,
    eta: str | None = None,
) -> list[tuple[str, int]]:
    """The figures of a logged step in reading order, each with its rank (the highest is left out first where
    the line must be shorter)."""
    parts = [(f"step {step}/{total}", 0), (f"loss {loss:.4f}", 0)]
    if learning_rate is not None:
        parts.append((f"lr {plain_number(learning_rate)}", 3))
    if grad_norm is not None:
        parts.append((f"grad norm {plain_number(grad_norm)}", 4))
    if tokens_per_second is not None:
        parts.append((f"{tokens_per_second_text(tokens_per_second)} tok/s", 2))
    if mfu is not None:
        parts.append((f"MFU {100 * mfu:.1f}%", 5))
    if eta is not None:
        parts.append((f"ETA {eta}", 1))
    return parts


class _Figures(NamedTuple):
    """The last logged step's figures that the bar shows."""

    loss: float
    tokens_per_second: float
    mfu: float | None


class TrainingProgress:
    """A task on the run's console that counts finished steps, and a compact line per logged step.

    On a terminal the line prints above the live bar and fits the terminal's width; elsewhere it is a plain
    line with every figure. The other metrics go only to the trackers.
    """

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        running = current_console()
        self._own = running is None  # outside `train` (tests), a console of our own
        self.shown = RunConsole(enabled) if running is None else running
        self._figures: _Figures | None = None
        self._task = self.shown.progress.add_task(
            "train", total=total_steps, completed=start_step, parts=self._live_parts(start_step), eta="-"
        )
        self._completed = start_step
        # Dispatched steps whose results are not ready yet, oldest first: (step, an array of its result).
        self._pending: deque[tuple[int, Any]] = deque()

    def _live_parts(self, step: int) -> list[tuple[str, int]]:
        """The bar's figures: the step always, the last logged loss, tokens/s and MFU once there are some."""
        f = self._figures
        if f is None:
            return [(f"{step}/{self.total_steps}", 0)]
        parts = [(f"{step}/{self.total_steps}", 0), (f"loss {f.loss:.4f}", 0)]
        parts.append((f"{tokens_per_second_text(f.tokens_per_second)} tok/s", 2))
        if f.mfu is not None:
            parts.append((f"MFU {100 * f.mfu:.1f}%", 3))
        return parts

    def __enter__(self) -> TrainingProgress:
        if self._own:
            self.shown.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pending and exc[0] is None:  # the loop ended between log steps: its last steps are done by now
            self._pending[-1][1].block_until_ready()
            self._advance(self._pending[-1][0])
            self._pending.clear()
        if self._own:
            self.shown.__exit__(*exc)
        else:
            self.shown.progress.remove_task(self._task)

    def say(self, text: str) -> None:
        """What the run is doing while no step finishes: "compiling ...", "waiting for data ..."."""
        self.shown.progress.update(self._task, description=text)

    def dispatched(self, step: int, result: Any) -> None:
        """Step `step` is queued on the device; `result` (an array it outputs) tells when it is done."""
        self._pending.append((step, result))
        self.poll()

    def poll(self) -> None:
        """Advance over the dispatched steps whose results are ready (no wait, no device transfer)."""
        while self._pending and self._pending[0][1].is_ready():
            self._advance(self._pending.popleft()[0])

    def _advance(self, step: int) -> None:
        self._completed = step
        self.shown.progress.update(self._task, completed=step, description="train", parts=self._live_parts(step))

    def metrics(
        self,
        step: int,
        loss: float,
        tokens_per_second: float,
        mfu: float | None,
        seconds_per_step: float,
        *,
        learning_rate: float | None = None,
        grad_norm: float | None = None,
    ) -> None:
        """Show the metrics of `step`, whose result is fetched (so it and every step before it are done), on the
        bar and as the step's compact line."""
        while self._pending and self._pending[0][0] <= step:
            self._pending.popleft()
        self._figures = _Figures(loss, tokens_per_second, mfu)
        eta = format_duration(max(0, self.total_steps - step) * seconds_per_step)
        self.shown.progress.update(self._task, eta=eta)
        self._advance(step)
        figures = dict(learning_rate=learning_rate, grad_norm=grad_norm, tokens_per_second=tokens_per_second, mfu=mfu)
        self.line(step_parts(step, self.total_steps, loss, eta=eta, **figures))

    def line(self, parts: list[tuple[str, int]]) -> None:
        """Print a line of ranked parts: cut to the terminal's width on a terminal, whole in a log file."""
        if not self.enabled:
            return
        if self.shown.live:
            text = fit_parts(parts, self.shown.console.width - 1)
            self.shown.console.print(text, soft_wrap=True, markup=False, highlight=False)
        else:
            print("  ".join(text for text, _ in parts), file=sys.stderr, flush=True)

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """The eval loss of `step` as a line of its own (every other eval metric goes only to the trackers)."""
        if "eval/loss" in metrics:
            self.line([(f"step {step}/{self.total_steps}", 0), (f"eval/loss {metrics['eval/loss']:.4f}", 0)])

    def note(self, text: str) -> None:
        if self.enabled:
            self.shown.console.print(text, soft_wrap=True, markup=False, highlight=False)  # paths stay whole
