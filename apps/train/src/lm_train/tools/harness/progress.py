"""Progress of an lm-eval run: requests scored of those sent, and tasks whose requests are all scored."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from lm_train.run.console import RunConsole, current_console


class HarnessProgress:
    """A task on the run's console (a live line on a terminal; else a plain line at most every `every_s`
    seconds and whenever a task finishes) fed by the adapter as lm-eval's requests are scored.

    lm-eval sends all requests of one kind (loglikelihood, ...) at once, every task's in turn; the adapter
    registers them with `requests` and reports each scored batch with `scored`, by their positions.
    """

    def __init__(self, tasks: Sequence[str], enabled: bool = True, every_s: float = 10.0):
        self.enabled = enabled
        self.tasks = list(tasks)
        self.every_s = every_s
        running = current_console()
        self._own = running is None  # `lm-train harness`: a console of its own; in a run, the run's
        self.shown = RunConsole(enabled) if running is None else running
        self._owners: list[str | None] = []  # the task of each request of the current kind, in lm-eval's order
        self._kind = ""
        self._remaining: Counter[str] = Counter()
        self._finished: set[str] = set()
        self._sent = self._scored = 0
        self._last_line = 0.0
        self._task = self.shown.progress.add_task("harness", total=None, parts=self._parts())

    def __enter__(self) -> HarnessProgress:
        if self._own:
            self.shown.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._own:
            self.shown.__exit__(*exc)
        else:
            self.shown.progress.remove_task(self._task)

    def requests(self, kind: str, instances: Sequence[Any]) -> None:
        """lm-eval sent `instances` of request type `kind`; their scoring starts now."""
        self._kind = kind
        self._owners = [getattr(instance, "task_name", None) for instance in instances]
        for name in self._owners:
            if name is not None:
                self._remaining[name] += 1
                self._finished.discard(name)
        self._sent += len(instances)
        self._show(force=True)

    def scored(self, positions: Iterable[int]) -> None:
        """The requests at these `positions` of those sent last are scored."""
        finished = False
        for position in positions:
            self._scored += 1
            name = self._owners[position]
            if name is None:
                continue
            self._remaining[name] -= 1
            if self._remaining[name] == 0:
                self._finished.add(name)
                finished = True
        self._show(force=finished)

    def _parts(self) -> list[tuple[str, int]]:
        tasks = max(len(self.tasks), len(self._remaining))
        parts = [(f"{self._scored:,}/{self._sent:,} requests", 0), (f"{len(self._finished)}/{tasks} tasks", 0)]
        return parts + ([(self._kind, 3)] if self._kind else [])

    def _show(self, force: bool) -> None:
        if not self.enabled:
            return
        self.shown.progress.update(self._task, completed=self._scored, total=self._sent or None, parts=self._parts())
        now = time.monotonic()
        if self.shown.live or not (force or now - self._last_line >= self.every_s):
            return
        self._last_line = now
        print("harness  " + "  ".join(text for text, _ in self._parts()), file=sys.stderr, flush=True)


__all__ = ["HarnessProgress"]
