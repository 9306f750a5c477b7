"""The run's trackers: the configured ones plus the always-on metrics.jsonl, current for the whole loop."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trackers
from lm_train.config.trainer_config import TrackerList
from lm_train.errors import ConfigError
from lm_train.run.run_dir import RunPaths


def tracker_configs(configured: TrackerList, paths: RunPaths) -> list[trackers.TrackerConfig]:
    """The configured trackers, with a jsonl sink writing the run's metrics.jsonl first unless one is given, and
    without a console tracker: the run's console prints the summary and a compact line per logged step."""
    # A console tracker would print the whole config as a table and every metric of each logged step over the
    # live bar; `console` stays a valid tracker type (Levanter's configs name it), and the run's console is it.
    configs = [c for c in configured if not isinstance(c, trackers.ConsoleConfig)]
    if not any(isinstance(c, trackers.JsonlConfig) for c in configs):
        configs.insert(0, trackers.JsonlConfig(path=paths.metrics_file.name))
    return configs


def check_trackers_ready(configured: TrackerList, process_index: int) -> None:
    """Refuse, before any data is read, a configured tracker that could not start (wandb online with no API key)."""
    try:
        trackers.check_trackers_ready(list(configured), process_index=process_index, where="trainer.tracker")
    except trackers.TrackerConfigError as error:
        raise ConfigError(str(error)) from None


@contextmanager
def run_tracker(
    configured: TrackerList, paths: RunPaths, *, process_index: int, resume_from_step: int | None
) -> Iterator[trackers.Tracker]:
    """The tracker of a run, current inside the block (so `trackers.jit_log` from model or loss code reaches it),
    and finished on the way out."""
    tracker = trackers.build_tracker(
        tracker_configs(configured, paths),
        paths.run_dir,
        process_index=process_index,
        resume_from_step=resume_from_step,
    )
    try:
        with trackers.use_tracker(tracker):
            yield tracker
    finally:
        tracker.finish()
