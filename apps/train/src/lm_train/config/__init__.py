"""Typed configuration of a training run: schema, YAML loading, overrides."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lm_train.config.loading import dump_config, load_config
from lm_train.config.schema import (
    AdamConfig,
    CheckpointerConfig,
    DataConfig,
    KeepPolicy,
    OptimizerConfig,
    SophiaGConfig,
    SophiaHConfig,
    TrainerConfig,
    TrainLmConfig,
)


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
    "SophiaGConfig",
    "SophiaHConfig",
    "TrainLmConfig",
    "TrainerConfig",
    "dump_config",
    "load_train_config",
]
