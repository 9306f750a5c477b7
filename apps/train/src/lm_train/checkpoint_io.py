"""Open a run's checkpoint as a model: its config, tokenizer and parameters, without the optimizer state."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dist_ckpt
import named_tensors as nt
import shard_cache
from lm_train.config import TrainLmConfig, load_train_config
from lm_train.errors import CheckpointError
from lm_train.mesh import plan_mesh
from lm_train.optim import build_optimizer
from lm_train.run_dir import RunPaths


@dataclass
class LoadedModel:
    """A trained model with what is needed to use it."""

    config: TrainLmConfig
    model: Any
    tokenizer: Any
    step: int
    paths: RunPaths


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or the newest complete one under a folder of checkpoints or a run directory."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return path
    for root in (path, path / "checkpoints"):
        found = dist_ckpt.latest(root) if root.exists() else None
        if found is not None:
            return Path(found)
    raise CheckpointError(
        f"No complete checkpoint at {path}. Give a checkpoint directory (runs/<id>/checkpoints/step-N), a "
        "checkpoints folder, or a run directory."
    )


def load_model(checkpoint: Path) -> LoadedModel:
    """Read config.yaml and tokenizer.json of the checkpoint's run, then the model's parameters."""
    from lm_train.trainer import state_shapes

    checkpoint = resolve_checkpoint(checkpoint)
    paths = RunPaths.of_checkpoint(checkpoint)
    config, _ = load_train_config([paths.config_file])
    tokenizer = shard_cache.load_tokenizer(str(paths.tokenizer_file))
    Vocab = nt.Axis("vocab", tokenizer.get_vocab_size(with_added_tokens=True))
    plan = plan_mesh(config.trainer)
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    target = state_shapes(config, plan, Vocab, optimizer)
    try:
        model = dist_ckpt.load(checkpoint, target.model, subtree=".model", progress=False)
        step = int(dist_ckpt.read_manifest(checkpoint).get("step", -1))
    except dist_ckpt.TreeMismatchError as e:
        raise CheckpointError(f"Checkpoint {checkpoint} does not match its run's config: {e}") from None
    return LoadedModel(config, model, tokenizer, step, paths)
