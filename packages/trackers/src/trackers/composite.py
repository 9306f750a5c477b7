"""A tracker that fans every call out to several trackers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trackers.tracker import Tracker


class TrackerErrors(ExceptionGroup):
    """The exceptions raised by some trackers of a CompositeTracker, after all of them were called."""


class CompositeTracker(Tracker):
    """Calls each tracker in turn; if some fail, the others still run, then TrackerErrors is raised."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        for tracker in trackers:
            if not isinstance(tracker, Tracker):
                raise TypeError(
                    f"CompositeTracker takes Tracker objects, got a {type(tracker).__name__}; build trackers "
                    "with a config's .build(...) or a backend class such as JsonlTracker(path)."
                )
        self.trackers: tuple[Tracker, ...] = tuple(trackers)

    def _fan_out(self, what: str, call: Callable[[Tracker], None]) -> None:
        errors: list[Exception] = []
        for tracker in self.trackers:
            try:
                call(tracker)
            except Exception as error:
                error.add_note(f"raised by {type(tracker).__name__}.{what}")
                errors.append(error)
        if errors:
            failed = ", ".join(f"{type(e).__name__}: {e}" for e in errors)
            raise TrackerErrors(f"{len(errors)} of {len(self.trackers)} trackers failed in {what} ({failed})", errors)

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """Send hyperparameters to every tracker."""
        self._fan_out("log_hyperparameters", lambda t: t.log_hyperparameters(hyperparameters))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Send metrics to every tracker."""
        self._fan_out(f"log(step={step})", lambda t: t.log(metrics, step))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Send a summary to every tracker."""
        self._fan_out("log_summary", lambda t: t.log_summary(summary))

    def log_artifact(self, path: str | Path, name: str | None = None, type: str = "file") -> None:
        """Send an artifact to every tracker."""
        self._fan_out("log_artifact", lambda t: t.log_artifact(path, name, type))

    def finish(self) -> None:
        """Finish every tracker, even when some fail."""
        self._fan_out("finish", lambda t: t.finish())
