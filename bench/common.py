"""Helpers shared by the benchmarks: the machine's description, timing, and the one-JSON-line report.

Every benchmark prints exactly one JSON object per line on stdout:

    {"name": ..., <figures>..., "reference": <the reference figure>, "ratio": <ours / reference, >1 is better
     for us unless the line says otherwise>, "cpu_count": ..., "device": ..., "jax_version": ..., ...}

Import it from a script in bench/ as `from common import emit` (running `python bench/x.py` puts bench/ on
sys.path). jax is imported lazily so that scripts that time `import jax` themselves can use this module too.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_train.run.host_memory import hugepage_malloc_active

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str | None:
    """The short commit of the working tree the benchmark ran from (None outside git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_info() -> dict[str, Any]:
    """Backend, device kind and count as jax sees them (imports jax)."""
    import jax

    devices = jax.devices()
    first = devices[0]
    kind = getattr(first, "device_kind", "") or first.platform
    return {
        "backend": jax.default_backend(),
        "device": f"{len(devices)} x {kind}" if first.platform != "cpu" else f"cpu ({platform.processor() or kind})",
        "device_count": len(devices),
        "jax_version": jax.__version__,
    }


def machine_info() -> dict[str, Any]:
    """Fields every JSON line carries: cores, device, versions, malloc on huge pages (as `lm-train` runs), commit,
    time."""
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        **device_info(),
        "python": platform.python_version(),
        "huge_page_malloc": hugepage_malloc_active(),
        "commit": git_commit(),
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def emit(name: str, figures: dict[str, Any], *, reference: Any, ratio: float | None, **extra: Any) -> dict[str, Any]:
    """Print one JSON line: name, the figures, the reference and the ratio, then the machine's description."""
    line = {"name": name, **figures, "reference": reference, "ratio": _round(ratio), **extra, **machine_info()}
    print(json.dumps(line), flush=True)
    return line


def log(*parts: Any) -> None:
    """Progress notes go to stderr, so that stdout holds only the JSON lines."""
    print(*parts, file=sys.stderr, flush=True)


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def time_call(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of fn() (which must block until its work is done) and its value."""
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    """The fastest of `repeats` timed calls: noise from neighbours only ever adds time."""
    return min(time_call(fn)[0] for _ in range(repeats))


def median(values: list[float]) -> float:
    return statistics.median(values)


__all__ = ["REPO_ROOT", "best_of", "device_info", "emit", "git_commit", "log", "machine_info", "median", "time_call"]
