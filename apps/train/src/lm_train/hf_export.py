"""Hugging Face exports: `lm-train export-hf`, and the exports a run makes as it trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

import hf_bridge
from lm_train.checkpoints import load_model
from lm_train.config.schema import TrainLmConfig
from lm_train.run_dir import RunPaths


def host_model(model: Any) -> Any:
    """The model with every array gathered to this host as numpy (all processes must call this together)."""
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, model)
    from jax.experimental import multihost_utils

    return jax.tree_util.tree_map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)) if isinstance(x, jax.Array) else x,
        model,
    )


def export_model(model: Any, model_config: Any, tokenizer_file: Path, out_dir: Path, *, overwrite: bool) -> None:
    """Write config.json, safetensors and the tokenizer (process 0 writes; every process must call this)."""
    local = host_model(model)
    if jax.process_index() == 0:
        hf_bridge.save_pretrained(local, model_config, out_dir, tokenizer=str(tokenizer_file), overwrite=overwrite)


def export_during_training(config: TrainLmConfig, paths: RunPaths, model: Any, step: int) -> Path:
    """The export a run makes at its end and every hf_save_steps: <hf_save_path or run_dir/hf>/step-N."""
    out = (Path(config.hf_save_path) if config.hf_save_path else paths.hf) / f"step-{step}"
    export_model(model, config.model, paths.tokenizer_file, out, overwrite=True)
    return out


def export_checkpoint(checkpoint: Path, out_dir: Path, *, overwrite: bool = False, dtype: str | None = None) -> Path:
    """Export a run's checkpoint as a Hugging Face model directory; returns the checkpoint it exported."""
    loaded = load_model(checkpoint)
    hf_bridge.save_pretrained(
        host_model(loaded.model),
        loaded.config.model,
        out_dir,
        tokenizer=str(loaded.paths.tokenizer_file),
        dtype=dtype,
        overwrite=overwrite,
    )
    return loaded.checkpoint
