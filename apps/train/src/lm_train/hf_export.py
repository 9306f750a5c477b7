"""Hugging Face exports: `lm-train export-hf`, and the exports a run makes as it trains.

hf-bridge writes the sharded model tensor by tensor (process 0 writes, every process takes part), so no
process ever holds the whole model on its host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_bridge
from lm_train.checkpoints import load_model
from lm_train.config.schema import TrainLmConfig
from lm_train.run_dir import RunPaths


def export_model(model: Any, model_config: Any, tokenizer_file: Path, out_dir: str, *, overwrite: bool) -> None:
    """Write config.json, sharded safetensors and the tokenizer (every process must call this)."""
    hf_bridge.save_pretrained(model, model_config, out_dir, tokenizer=str(tokenizer_file), overwrite=overwrite)


def export_during_training(config: TrainLmConfig, paths: RunPaths, model: Any, step: int) -> str:
    """The export a run makes at its end and every hf_save_steps: <hf_save_path or run_dir/hf>/step-N."""
    # A string, not a Path: Path("s3://bucket/x") would collapse the URL's double slash.
    base = config.hf_save_path.rstrip("/") if config.hf_save_path else str(paths.hf)
    out = f"{base}/step-{step}"
    export_model(model, config.model, paths.tokenizer_file, out, overwrite=True)
    return out


def export_checkpoint(
    checkpoint: str | Path, out_dir: str, *, overwrite: bool = False, dtype: str | None = None
) -> Path:
    """Export a run's checkpoint as a Hugging Face model directory; returns the checkpoint it exported."""
    loaded = load_model(checkpoint)
    hf_bridge.save_pretrained(
        loaded.model,
        loaded.config.model,
        out_dir,
        tokenizer=str(loaded.paths.tokenizer_file),
        dtype=dtype,
        overwrite=overwrite,
    )
    return loaded.checkpoint
