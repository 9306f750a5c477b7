"""Typed configuration of a training run: schema, YAML loading, overrides.

Importing this package is light: the schema (which imports the model families, hence jax) loads on first use,
so that a missing file, bad YAML or a malformed flag is reported before jax is imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lm_train.config.schema import TrainLmConfig

_LAZY = {
    "DataConfig": "lm_train.config.data_config",
    "DpoConfig": "lm_train.config.dpo_config",
    "AdamConfig": "lm_train.config.optimizer_config",
    "OptimizerConfig": "lm_train.config.optimizer_config",
    "ScheduleConfig": "lm_train.config.optimizer_config",
    "SophiaGConfig": "lm_train.config.optimizer_config",
    "SophiaHConfig": "lm_train.config.optimizer_config",
    "MuonConfig": "lm_train.config.optimizer_recipes",
    "MarsConfig": "lm_train.config.optimizer_recipes",
    "SoapConfig": "lm_train.config.optimizer_recipes",
    "KronConfig": "lm_train.config.kron_config",
    "TrainLmConfig": "lm_train.config.schema",
    "CheckpointerConfig": "lm_train.config.trainer_config",
    "RayClusterConfig": "lm_train.config.trainer_config",
    "KeepPolicy": "lm_train.config.trainer_config",
    "TrainerConfig": "lm_train.config.trainer_config",
    "TrackerList": "lm_train.config.trainer_config",
    "WatchConfig": "lm_train.config.trainer_config",
    "WatchdogConfig": "lm_train.config.trainer_config",
    "ProfilerConfig": "lm_train.config.watching_config",
    "EvalHarnessConfig": "lm_train.config.watching_config",
    "dump_config": "lm_train.config.loading",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lm_train.config' has no attribute {name!r}")


def load_train_config(
    paths: Sequence[str | Path], overrides: Sequence[str] = ()
) -> tuple[TrainLmConfig, dict[str, Any]]:
    """Read, merge, override and validate a training config."""
    from lm_train.config.yaml_files import read_merged

    raw, sources = read_merged(paths, overrides)  # file, YAML and flag errors come here, before jax is imported
    from lm_train.config.hf_model_section import check_written_model_keys, fill_model_from_hf
    from lm_train.config.loading import decode_config
    from lm_train.config.schema import TrainLmConfig

    filled = fill_model_from_hf(raw, sources)  # initialize_from_hf's config.json gives the keys not written
    config = decode_config(TrainLmConfig, raw, sources)
    if filled is not None:
        check_written_model_keys(filled, config.model, sources)
    return config, raw


__all__ = [*sorted(_LAZY), "load_train_config"]
