"""Typed configuration of a training run: schema, YAML loading, overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lm_train.config.data_config import DataConfig
from lm_train.config.loading import dump_config, load_config
from lm_train.config.optimizer_config import (
    AdamConfig,
    OptimizerConfig,
    ScheduleConfig,
    SophiaGConfig,
    SophiaHConfig,
)
from lm_train.config.schema import TrainLmConfig
from lm_train.config.trainer_config import CheckpointerConfig, KeepPolicy, TrackerList, TrainerConfig, WatchConfig


def load_train_config(
    paths: Sequence[str | Path], overrides: Sequence[str] = ()
) -> tuple[TrainLmConfig, dict[str, Any]]:
    """Read, merge, override and validate a training config."""
    return load_config(TrainLmConfig, paths, overrides)


__all__ = [
    "AdamConfig",
    "CheckpointerConfig",
    "DataConfig",
    "KeepPolicy",
    "OptimizerConfig",
    "ScheduleConfig",
    "SophiaGConfig",
    "SophiaHConfig",
    "TrackerList",
    "TrainLmConfig",
    "TrainerConfig",
    "WatchConfig",
    "dump_config",
    "load_train_config",
]
