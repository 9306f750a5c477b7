"""A tracker that records nothing (e.g. on processes other than 0)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trackers.tracker import Tracker
from trackers.values import plain_metrics, plain_step


class NoopTracker(Tracker):
    """Accepts every call and records nothing; still checks its input so mistakes surface everywhere."""

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """Discard hyperparameters."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Validate, then discard, metrics."""
        plain_step(step)
        plain_metrics(metrics)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Discard a summary."""

    def log_artifact(self, path: str | Path, name: str | None = None, type: str = "file") -> None:
        """Discard an artifact."""

    def finish(self) -> None:
        """Nothing to close."""
