"""Logging from inside jitted and scanned code, to the current tracker on the host."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import jax

from trackers import current

# Steps set by `logging_step` while a function is traced: deep code (a model, a loss) then logs without being
# passed the step. A plain stack, not a ContextVar: tracing runs on the caller's thread, synchronously.
_steps: list[Any] = []


@contextmanager
def logging_step(step: Any) -> Iterator[None]:
    """Inside the block, `jit_log` calls without `step=` log at `step` (a traced value is fine).

    A trainer wraps its step function's body in it, so that model or loss code can call `jit_log(metrics)`.
    """
    _steps.append(step)
    try:
        yield
    finally:
        _steps.pop()


def _log_on_host(metrics: dict[str, Any], step: Any) -> None:
    current.log(metrics, step)


def jit_log(metrics: Mapping[str, Any], *, step: Any = None, ordered: bool = False) -> None:
    """Log `metrics` (arrays, numbers, Histograms) at `step` (traced or not) to the current tracker.

    Without `step`, the step of the innermost `logging_step` block is used. Works inside `jax.jit`, `lax.scan`
    and outside them. The values reach the tracker in the order of execution: one step after another, scan
    iterations in order. Two calls in the same computation that do not depend on each other may arrive in either
    order; `ordered=True` fixes program order, which jax supports only for computations on a single device.
    Call `wait_for_jit_logs()` (or leave the `use_tracker` block) before reading what was written.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"jit_log takes a mapping of name to value, got a {type(metrics).__name__}.")
    for key, value in metrics.items():
        if isinstance(value, str):
            raise TypeError(
                f"jit_log cannot carry the string metric {key!r} out of jit; log text from the host with "
                "trackers.log(...)."
            )
    if step is None:
        if not _steps:
            raise TypeError(
                "jit_log needs a step: pass step=..., or call it inside a `trackers.logging_step(step)` block (the "
                "trainer's step function sets one)."
            )
        step = _steps[-1]
    jax.debug.callback(_log_on_host, dict(metrics), step, ordered=ordered)
