"""The latest counts of on-the-fly cache builds, kept on the host for the training loop to log."""

from __future__ import annotations

import threading
from typing import Any

# `nodes`: the Ray nodes that tokenized shards so far (a multi-host run's cluster shows whether every host helps).
LOGGED_KEYS = ("docs", "tokens", "shards_finished", "tokens_per_second", "nodes")


class LatestBuildMetrics:
    """The build thread hands each commit's BuildMetrics here; the loop reads them at its log interval."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: Any = None
        self._logged: Any = None

    def __call__(self, metrics: Any) -> None:
        with self._lock:
            self._latest = metrics

    def latest(self) -> Any:
        """The last BuildMetrics handed over (None before the build's first commit)."""
        return self._latest  # one reference, read atomically: no lock needed

    def take(self) -> tuple[Any, bool]:
        """The last BuildMetrics (None before the first commit), and whether it is new since the last take."""
        with self._lock:
            latest, new = self._latest, self._latest is not None and self._latest is not self._logged
            self._logged = latest
        return latest, new

    def for_source(self, name: str) -> LatestBuildMetrics:
        """What watches one source's train build: this, the only one."""
        return self

    def percent(self) -> float | None:
        """How far the build is, by input bytes (by shards when sizes are unknown); None before its first commit."""
        return _percent([m for m in [self.latest()] if m is not None])

    def new_values(self) -> dict[str, float]:
        """`preprocessing/docs`, `/tokens`, `/shards_finished`, `/tokens_per_second`, `/nodes` if the build
        committed since the last call, else nothing (a finished build stops adding lines)."""
        latest, new = self.take()
        return _logged_values(latest, "preprocessing/") if new else {}


class MixtureBuildMetrics:
    """Each building source's LatestBuildMetrics, read together: per-source counts and their totals."""

    def __init__(self, names: list[str]) -> None:
        self.sources = {name: LatestBuildMetrics() for name in names}

    def for_source(self, name: str) -> LatestBuildMetrics | None:
        """What watches one source's train build (None for a source that is not building)."""
        return self.sources.get(name)

    def percent(self) -> float | None:
        """How far the sources that have committed are, together; None before any source's first commit."""
        return _percent([m for m in (s.latest() for s in self.sources.values()) if m is not None])

    def new_values(self) -> dict[str, float]:
        """`preprocessing/<source>/<key>` of the sources that committed since the last call and, if any did, the
        totals `preprocessing/<key>` over every source's latest counts."""
        taken = {name: watched.take() for name, watched in self.sources.items()}
        values: dict[str, float] = {}
        for name, (latest, new) in taken.items():
            if new:
                values.update(_logged_values(latest, f"preprocessing/{name}/"))
        if not values:
            return {}
        latest = [m for m, _ in taken.values() if m is not None]
        values["preprocessing/docs"] = float(sum(m.docs for m in latest))
        values["preprocessing/tokens"] = float(sum(m.tokens for m in latest))
        values["preprocessing/shards_finished"] = float(sum(m.shards_done for m in latest))
        # The sources build side by side from about the same moment: this run's tokens over the longest elapsed time.
        elapsed = max(m.elapsed_s for m in latest)
        built = sum(m.tokens - m.tokens_at_start for m in latest)
        values["preprocessing/tokens_per_second"] = built / elapsed if elapsed > 0 else 0.0
        return values


def _logged_values(metrics: Any, prefix: str) -> dict[str, float]:
    values = metrics.as_dict()
    return {prefix + k: float(values[f"preprocessing/{k}"]) for k in LOGGED_KEYS}


def _percent(reported: list[Any]) -> float | None:
    if not reported:
        return None
    if all(m.bytes_total for m in reported):
        return 100.0 * sum(m.bytes_done for m in reported) / sum(m.bytes_total for m in reported)
    return 100.0 * sum(m.shards_done for m in reported) / max(sum(m.shards_total for m in reported), 1)
