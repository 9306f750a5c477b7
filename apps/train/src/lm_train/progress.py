"""The training bar: step, loss, tokens/s, MFU and ETA, advanced when a step's result is ready."""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

from lm_train.run_console import RunConsole, current_console


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class TrainingProgress:
    """A task on the run's console that counts finished steps; metrics refresh whenever they are logged.

    `print_steps`: without a terminal, print one line per logged step (off when a console tracker prints it).
    """

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True, print_steps: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        self._own = current_console() is None  # outside `train` (tests), a console of our own
        self.shown = RunConsole(enabled) if self._own else current_console()
        self._plain = enabled and print_steps and not self.shown.live
        self._fields = {"loss": "-", "tps": "-", "mfu": "-"}
        self._task = self.shown.progress.add_task(
            "train", total=total_steps, completed=start_step, stats=self._stats(start_step), eta="-"
        )
        self._completed = start_step
        # Dispatched steps whose results are not ready yet, oldest first: (step, an array of its result).
        self._pending: deque[tuple[int, Any]] = deque()

    def _stats(self, step: int) -> str:
        f = self._fields
        return f"{step}/{self.total_steps}  loss {f['loss']}  {f['tps']} tok/s  MFU {f['mfu']}"

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
        self.shown.progress.update(self._task, completed=step, description="train", stats=self._stats(step))

    def metrics(
        self, step: int, loss: float, tokens_per_second: float, mfu: float | None, seconds_per_step: float
    ) -> None:
        """Show the metrics of `step`, whose result is fetched (so it and every step before it are done)."""
        while self._pending and self._pending[0][0] <= step:
            self._pending.popleft()
        self._fields = {
            "loss": f"{loss:.4f}",
            "tps": f"{tokens_per_second:,.0f}",
            "mfu": "-" if mfu is None else f"{100 * mfu:.1f}%",
        }
        eta = format_duration(max(0, self.total_steps - step) * seconds_per_step)
        self.shown.progress.update(self._task, eta=eta)
        self._advance(step)
        if self._plain:
            print(f"step {self._stats(step)}  ETA {eta}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            self.shown.console.print(text, soft_wrap=True, markup=False, highlight=False)  # paths stay whole
