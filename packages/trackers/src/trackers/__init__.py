"""Metric sinks for training runs (wandb, TensorBoard, jsonl, console), a current tracker, and jit logging.

`import trackers` imports neither jax, wandb nor tensorboardX: backends import their library when built,
and `jit_log` / `logging_step` / `summarize_tree` import jax on first use.
"""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from trackers.builtin_configs import ConsoleConfig, JsonlConfig, NoopConfig, TensorboardConfig, WandbConfig
from trackers.composite import CompositeTracker, TrackerErrors
from trackers.config_registry import (
    TrackerConfig,
    TrackerConfigError,
    build_tracker,
    check_trackers_ready,
    register_tracker_config,
    tracker_config_from_dict,
    tracker_config_types,
    tracker_configs_from_value,
)
from trackers.console import ConsoleTracker
from trackers.current import (
    NoCurrentTrackerError,
    current_tracker,
    log,
    log_hyperparameters,
    log_summary,
    use_tracker,
    wait_for_jit_logs,
)
from trackers.histogram import Histogram
from trackers.jsonl import JsonlTracker, read_jsonl
from trackers.noop import NoopTracker
from trackers.process import current_process_index
from trackers.tensorboard_tracker import TensorboardTracker
from trackers.tracker import FinishedTrackerError, Tracker
from trackers.values import MetricValueError
from trackers.wandb_tracker import WandbTracker

if TYPE_CHECKING:  # what __getattr__ below loads lazily, named for type checkers only
    from trackers.jit import jit_log, logging_step
    from trackers.summary import summarize_tree

__version__ = _metadata.version("trackers")  # the installed distribution's: no copy to drift

_needs_jax = {"jit_log": "trackers.jit", "logging_step": "trackers.jit", "summarize_tree": "trackers.summary"}


def __getattr__(name: str) -> Any:
    # jit_log, logging_step and summarize_tree import jax; load them only when asked for.
    if name in _needs_jax:
        import importlib

        return getattr(importlib.import_module(_needs_jax[name]), name)
    raise AttributeError(f"module 'trackers' has no attribute {name!r}")


__all__ = [
    "CompositeTracker",
    "ConsoleConfig",
    "ConsoleTracker",
    "FinishedTrackerError",
    "Histogram",
    "JsonlConfig",
    "JsonlTracker",
    "MetricValueError",
    "NoCurrentTrackerError",
    "NoopConfig",
    "NoopTracker",
    "TensorboardConfig",
    "TensorboardTracker",
    "Tracker",
    "TrackerConfig",
    "TrackerConfigError",
    "TrackerErrors",
    "WandbConfig",
    "WandbTracker",
    "__version__",
    "build_tracker",
    "check_trackers_ready",
    "current_process_index",
    "current_tracker",
    "jit_log",
    "log",
    "log_hyperparameters",
    "log_summary",
    "logging_step",
    "read_jsonl",
    "register_tracker_config",
    "summarize_tree",
    "tracker_config_from_dict",
    "tracker_config_types",
    "tracker_configs_from_value",
    "use_tracker",
    "wait_for_jit_logs",
]
