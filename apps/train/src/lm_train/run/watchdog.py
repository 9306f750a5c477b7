"""`trainer.watchdog`: a step that runs far too long (a hang, a stuck host) makes every process dump every
thread's stack into <run_dir>/hangs/ and ends the run with one paragraph naming the slow hosts, so that a
launcher restarts it."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_STATUS = 75  # EX_TEMPFAIL, "try again": a launcher restarts the run, and the rerun resumes
UNTIMED_STEPS = 2  # the first steps wait for every host's compile (and, dispatched ahead, for each other)
AUTO_STEPS = 20  # the automatic timeout is set once this many steps have been timed
AUTO_MULTIPLE = 20  # ... at this multiple of their median
AUTO_FLOOR_S = 300.0  # ... and never under five minutes: a storage hiccup or a GC pause is no hang
EXCUSED_EXTRA_S = 3600.0  # more time for a step after an eval, export or save (process 0 may be alone in it)
REPORT_WAIT_S = 10.0  # how long each process waits for the others' reports once its own watchdog fired
STALL_ENV = "LM_TRAIN_TEST_STALL_AT_STEP"  # tests: this process stops stepping after this step
_KEYS = "lm_train/watchdog"

# What a process is doing when its watchdog fires: the loop sets it around each wait (its own work else).
HOST = "busy with its own work"
SAVE = "in a checkpoint save"
DEVICE = "waiting for the device"
DECISION = "waiting for process 0's decision"
OTHERS = "waiting for the other processes' step times"


class Watchdog:
    """A thread with a deadline: `beat(step)` as the loop takes each step moves it; past it, every thread's stack
    is dumped and the run ended. Once one process's watchdog fires, every other process's follows at once.

    The loop's part is a few attribute writes per step; the thread wakes at most once a second.
    """

    def __init__(self, timeout_s: float | None, hangs_dir: Path, process_index: int, process_count: int):
        self.timeout = timeout_s  # None: set from the first AUTO_STEPS steps
        self.automatic = timeout_s is None
        self.hangs_dir = hangs_dir
        self.process_index, self.process_count = process_index, process_count
        self.phase = HOST  # what the loop is waiting for now, for the report
        self._last_beat: float | None = None  # None until the first steps are done: nothing is timed before
        self._step = self._beats = 0
        self._excused = self._excuse_next = False
        self._durations: list[float] = []
        self._closed = threading.Event()
        if timeout_s != 0:  # off: no thread, and the loop's calls only write attributes
            threading.Thread(target=self._watch, name="lm-train watchdog", daemon=True).start()

    @classmethod
    def for_run(cls, timeout_s: float | None, run_dir: Path, process: tuple[int, int]) -> Watchdog:
        """The run's watchdog (trainer.watchdog.timeout_s: seconds, None for automatic, 0 for off)."""
        return cls(timeout_s, run_dir / "hangs", *process)

    def beat(self, step: int) -> None:
        """The loop takes `step`: a fresh deadline."""
        now = time.monotonic()
        self._beats += 1
        if self._beats <= UNTIMED_STEPS:
            self._step, self.phase = step, HOST
            return
        if self.automatic and self.timeout is None and self._last_beat is not None and not self._excused:
            self._durations.append(now - self._last_beat)
            if len(self._durations) == AUTO_STEPS:
                self.timeout = max(AUTO_MULTIPLE * statistics.median(self._durations), AUTO_FLOOR_S)
        self._last_beat, self._step, self.phase = now, step, HOST
        self._excused, self._excuse_next = self._excuse_next, False

    def excuse(self) -> None:
        """Work beside the step (an eval, an export, a save, a wait for data) gets EXCUSED_EXTRA_S more, in this
        step and the next: the next, because another process may wait in it while process 0 is still alone in
        that work. Every process excuses the same steps, as each runs the same schedule."""
        self._excused = self._excuse_next = True

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, (self.timeout or 10.0) / 10)):
            last, timeout = self._last_beat, self.timeout
            late = 0.0 if last is None else time.monotonic() - last
            limit = None if last is None or timeout is None else timeout + (EXCUSED_EXTRA_S if self._excused else 0.0)
            overdue = limit is not None and late > limit
            if overdue or (self.process_count > 1 and _another_fired()):
                self._fire(late, timeout)

    def _fire(self, late: float, timeout: float | None) -> None:
        """Dump, tell, and end the process: its main thread is stuck, so only os._exit ends it."""
        step, phase = self._step, self.phase
        if self.process_count > 1:
            _tell_the_others(self.process_index)
        dump = dump_stacks(self.hangs_dir / f"process-{self.process_index}-step-{step}.txt", step, late)
        reports = {self.process_index: {"step": step, "phase": phase, "late": late}}
        if self.process_count > 1:
            reports = _exchange(self.process_index, self.process_count, reports[self.process_index])
        text = hang_message(step, late, timeout, self.automatic, reports, self.process_count, dump.parent)
        print(text, file=sys.stderr, flush=True)
        if self.process_count > 1:
            _leave_together(self.process_index, self.process_count)
        os._exit(EXIT_STATUS)


def dump_stacks(path: Path, step: int, late: float) -> Path:
    """Every thread's stack, with its name, into `path` (written whole, then renamed into place)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = [f"pid {os.getpid()}: no step done for {late:.1f} s, at step {step}; every thread's stack follows.\n"]
    for ident, frame in sys._current_frames().items():
        lines.append(f"\n--- thread {names.get(ident, '?')} ({ident}) ---\n")
        lines.extend(traceback.format_stack(frame))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(lines), encoding="utf-8")
    partial.replace(path)
    return path


def _client() -> Any:
    from lm_train.run.distributed import coordination_client

    return coordination_client()


def _another_fired() -> bool:
    try:
        return bool(_client().key_value_dir_get(f"{_KEYS}/fired/"))
    except Exception:  # the coordination service is gone: the process that ran it is; the deadline decides
        return False


def _tell_the_others(index: int) -> None:
    with contextlib.suppress(Exception):  # the coordination service is gone: the others' deadlines end them
        _client().key_value_set(f"{_KEYS}/fired/{index}", "1")


def _exchange(index: int, count: int, mine: dict) -> dict[int, dict]:
    """Publish this process's report and gather those that come within REPORT_WAIT_S (a process that holds the
    interpreter, or is gone, never reports)."""
    reports = {index: mine}
    try:
        client = _client()
        client.key_value_set(f"{_KEYS}/report/{index}", json.dumps(mine))
        deadline = time.monotonic() + REPORT_WAIT_S
        while len(reports) < count and time.monotonic() < deadline:
            for key, value in client.key_value_dir_get(f"{_KEYS}/report/"):
                reports[int(key.rsplit("/", 1)[-1])] = json.loads(value)
            time.sleep(0.2)
    except Exception:  # the coordinator may be the process that is gone; report what is known
        pass
    return reports


def _leave_together(index: int, count: int) -> None:
    """Process 0 hosts the coordination service: it leaves last, so that no other process loses the service (and
    dies of it) before it has printed its report."""
    try:
        client = _client()
        if index != 0:
            client.key_value_set(f"{_KEYS}/left/{index}", "1")
            return
        deadline = time.monotonic() + REPORT_WAIT_S
        while len(client.key_value_dir_get(f"{_KEYS}/left/")) < count - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # their os._exit follows their key at once
    except Exception:  # a coordinator already gone: nothing to wait for
        pass


def slow_hosts(reports: dict[int, dict], count: int) -> tuple[list[int], list[int]]:
    """(the hosts that hold the run up, those that did not report): a host busy with its own work, else one in a
    checkpoint save, else the furthest behind when every reporting host waits (for the device, for the others)."""
    silent = [index for index in range(count) if index not in reports]
    for phase in (HOST, SAVE):
        busy = sorted(index for index, report in reports.items() if report["phase"] == phase)
        if busy or silent:
            return busy, silent
    behind = min(report["step"] for report in reports.values())
    return sorted(index for index, report in reports.items() if report["step"] == behind), silent


def hang_message(
    step: int, late: float, timeout: float | None, automatic: bool, reports: dict[int, dict], count: int, hangs: Path
) -> str:
    """The paragraph the run ends with: how long, the limit, the slow hosts, the dumps, the fix."""
    if timeout is None:
        limit = f"automatic, not yet set: fewer than {AUTO_STEPS} steps were timed"
    else:
        limit = f"{timeout:.0f} s, set from the median step time" if automatic else f"{timeout:g} s"
    if count == 1:
        where = f"It was {reports[next(iter(reports))]['phase']}."
    else:
        busy, silent = slow_hosts(reports, count)
        slow = [f"process {i} ({reports[i]['phase']} at step {reports[i]['step']})" for i in busy]
        slow += [f"process {i} (no report: gone, or stuck holding the interpreter)" for i in silent]
        others = [
            f"process {i} ({r['phase']} at step {r['step']})" for i, r in sorted(reports.items()) if i not in busy
        ]
        where = f"Slow: {', '.join(slow) or 'none found'}." + (f" The others: {', '.join(others)}." if others else "")
    return (
        f"lm-train: the watchdog ended the run: no step was done for {late:.0f} s, at step {step} "
        f"(trainer.watchdog.timeout_s: {limit}). {where} Every thread's stack of each process is in {hangs}/. "
        f"The exit status is {EXIT_STATUS}, so that a launcher restarts the run; the rerun resumes from the newest "
        "checkpoint. If steps this slow are expected, raise trainer.watchdog.timeout_s (0 turns the watchdog off)."
    )


def data_wait(watchdog: Watchdog, caches_finished: Callable[[], bool], then: Callable[[], None]) -> Callable[[], None]:
    """A prefetcher's `on_wait`: while the train caches are still being built, the wait for a batch goes at the
    build's pace, not the step's, so the watchdog gives it more time; then `then()`."""
    finished = False

    def on_wait() -> None:
        nonlocal finished
        finished = finished or caches_finished()  # read until they are, then never again
        if not finished:
            watchdog.excuse()
        then()

    return on_wait


def injected_stall() -> int | None:
    """The step after which a test makes this process stop stepping (LM_TRAIN_TEST_STALL_AT_STEP), if any."""
    value = os.environ.get(STALL_ENV, "")
    return int(value) if value else None


__all__ = ["EXIT_STATUS", "Watchdog", "data_wait", "dump_stacks", "hang_message", "injected_stall", "slow_hosts"]
