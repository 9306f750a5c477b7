"""The latest counts of an on-the-fly cache build, kept on the host for the training loop to log."""

from __future__ import annotations

import threading
from typing import Any

LOGGED_KEYS = ("docs", "tokens", "shards_finished", "tokens_per_second")


class LatestBuildMetrics:
    """The build thread hands each commit's BuildMetrics here; the loop reads them at its log interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: Any = None
        self._logged: Any = None

    def __call__(self, metrics: Any) -> None:
        with self._lock:
            self._latest = metrics

    def percent(self) -> float | None:
        """How far the build is, by input bytes (by shards when sizes are unknown); None before its first commit."""
        m = self._latest
        if m is None:
            return None
        if m.bytes_total:
            return 100.0 * m.bytes_done / m.bytes_total
        return 100.0 * m.shards_done / max(m.shards_total, 1)

    def new_values(self) -> dict[str, float]:
        """`preprocessing/docs`, `/tokens`, `/shards_finished`, `/tokens_per_second` if the build committed since
        the last call, else nothing (a finished build stops adding lines)."""
        with self._lock:
            latest = self._latest
            if latest is None or latest is self._logged:
                return {}
            self._logged = latest
        values = latest.as_dict()
        return {f"preprocessing/{k}": float(values[f"preprocessing/{k}"]) for k in LOGGED_KEYS}
