"""The Tracker protocol every metrics sink follows."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tracker(Protocol):
    """A metrics sink: hyperparameters once, metrics per step, a final summary, artifacts; then finish.

    Subclass it to inherit the context manager (leaving the `with` block calls `finish`).
    """

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """Record the run's configuration (nested mappings allowed)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record metric values (scalars, strings, Histograms) at a training step."""

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Record run-level results (final loss, total tokens...); later calls update earlier ones."""

    def log_artifact(self, path: str | Path, name: str | None = None, type: str = "file") -> None:
        """Record a file or directory produced by the run."""

    def finish(self) -> None:
        """Flush and close; calling it again does nothing."""

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


class FinishedTrackerError(RuntimeError):
    """Raised when a tracker is used after `finish()`."""


def raise_if_finished(tracker: Tracker, finished: bool) -> None:
    """Fail clearly instead of writing into a closed sink."""
    if finished:
        raise FinishedTrackerError(
            f"{type(tracker).__name__} was used after finish(); build a new tracker for a new run."
        )
