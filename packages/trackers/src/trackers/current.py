"""The current tracker: deep code (and jit_log callbacks) log to it without an object passed around."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from trackers.tracker import Tracker

# A process-wide stack rather than a ContextVar: jax runs jit_log callbacks on its own threads,
# which would not see a context variable set by the training loop's thread.
_stack: list[Tracker] = []
_lock = threading.Lock()


class NoCurrentTrackerError(RuntimeError):
    """Raised when something logs to the current tracker while there is none."""


def wait_for_jit_logs() -> None:
    """Block until every jit_log callback already dispatched has run (no-op when jax is not imported)."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.effects_barrier()


@contextmanager
def use_tracker(tracker: Tracker) -> Iterator[Tracker]:
    """Make `tracker` the current one inside the `with` block (blocks nest; the innermost wins).

    On leaving, waits for pending jit_log callbacks so that they still reach this tracker.
    It does not finish the tracker: `with tracker, use_tracker(tracker):` does both.
    """
    if not isinstance(tracker, Tracker):
        raise TypeError(f"use_tracker takes a Tracker, got a {type(tracker).__name__}.")
    with _lock:
        _stack.append(tracker)
    try:
        yield tracker
    finally:
        try:
            wait_for_jit_logs()
        finally:
            with _lock:
                # Remove this very entry even if an inner block leaked one of its own.
                for index in range(len(_stack) - 1, -1, -1):
                    if _stack[index] is tracker:
                        del _stack[index]
                        break


def current_tracker() -> Tracker:
    """The innermost tracker set with `use_tracker`."""
    with _lock:
        if _stack:
            return _stack[-1]
    raise NoCurrentTrackerError(
        "No current tracker: something called trackers.log / jit_log outside any "
        "`with trackers.use_tracker(tracker):` block. Wrap the training loop in one "
        "(use trackers.NoopTracker() to discard metrics on purpose)."
    )


def log(metrics: Mapping[str, Any], step: int) -> None:
    """Log metrics at `step` to the current tracker."""
    current_tracker().log(metrics, step)


def log_hyperparameters(hyperparameters: Mapping[str, Any]) -> None:
    """Log hyperparameters to the current tracker."""
    current_tracker().log_hyperparameters(hyperparameters)


def log_summary(summary: Mapping[str, Any]) -> None:
    """Log a summary to the current tracker."""
    current_tracker().log_summary(summary)
