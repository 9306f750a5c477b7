"""Logging from inside jitted and scanned code, to the current tracker on the host."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from trackers import current


def _log_on_host(metrics: dict[str, Any], step: Any) -> None:
    current.log(metrics, step)


def jit_log(metrics: Mapping[str, Any], *, step: Any, ordered: bool = False) -> None:
    """Log `metrics` (arrays, numbers, Histograms) at `step` (traced or not) to the current tracker.

    Works inside `jax.jit`, `lax.scan` and outside them. The values reach the tracker in the order of
    execution: one step after another, scan iterations in order. Two calls in the same computation that
    do not depend on each other may arrive in either order; `ordered=True` fixes program order, which
    jax supports only for computations on a single device. Call `wait_for_jit_logs()` (or leave the
    `use_tracker` block) before reading what was written.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"jit_log takes a mapping of name to value, got a {type(metrics).__name__}.")
    for key, value in metrics.items():
        if isinstance(value, str):
            raise TypeError(
                f"jit_log cannot carry the string metric {key!r} out of jit; log text from the host with "
                "trackers.log(...)."
            )
    jax.debug.callback(_log_on_host, dict(metrics), step, ordered=ordered)
