"""Finding and opening checkpoints: the one to resume from, the full state, or the model alone."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

import dist_ckpt
import named_tensors as nt
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import CheckpointError
from lm_train.post.lora_training import has_adapters, load_lora_model, split_trainable
from lm_train.run.mesh import MeshPlan
from lm_train.run.model_averaging import AVERAGED, averaged_model, chosen_weights
from lm_train.run.run_dir import RunPaths, read_run_config
from lm_train.run.state import TrainerState, model_shapes, shapes_of


def _as_given(given: str | Path, found: str | Path | None) -> str | Path | None:
    """dist-ckpt hands back absolute paths; under a relative root the user wrote, show them relative too."""
    if isinstance(found, Path) and "://" not in str(given) and not Path(given).is_absolute():
        return Path(os.path.relpath(found))
    return found


def committed_checkpoint(path: str | Path) -> str | Path | None:
    """`path` if it is a complete checkpoint, else the newest complete one under it or under path/checkpoints
    (a run directory); None if there is none. Local paths and s3:// / gs:// URLs alike."""
    for candidate in (path, f"{str(path).rstrip('/')}/checkpoints"):
        found = dist_ckpt.resolve_checkpoint(candidate)
        if found is not None:
            return _as_given(path, found)
    return None


def resolve_checkpoint(path: str | Path) -> str | Path:
    """Like `committed_checkpoint`, but finding none is a clear error."""
    found = committed_checkpoint(path)
    if found is None:
        raise CheckpointError(
            f"No complete checkpoint at {path}. Give a checkpoint directory (runs/<id>/checkpoints/step-N), a "
            "checkpoints folder, or a run directory."
        )
    return found


def checkpoint_root(config: TrainLmConfig, paths: RunPaths) -> str | Path:
    """Where a run's checkpoints live: trainer.checkpointer.base_path, else the run directory's checkpoints/."""
    return config.trainer.checkpointer.base_path or paths.checkpoints


def find_resume_checkpoint(config: TrainLmConfig, paths: RunPaths) -> str | Path | None:
    """The checkpoint a run resumes from, as trainer.load_checkpoint(_path) say; None to start fresh."""
    trainer = config.trainer
    if trainer.load_checkpoint_path:
        found = committed_checkpoint(trainer.load_checkpoint_path)
        if found is None:
            raise CheckpointError(
                f"trainer.load_checkpoint_path: no complete checkpoint at {trainer.load_checkpoint_path}. Point it at "
                "a checkpoint directory (…/checkpoints/step-N) or at a folder of them."
            )
        return found
    if trainer.load_checkpoint is False:
        return None
    root = checkpoint_root(config, paths)
    found = _as_given(root, dist_ckpt.latest(root))
    if found is None and trainer.load_checkpoint:
        raise CheckpointError(
            f"trainer.load_checkpoint is true but {root} holds no complete checkpoint. Remove the flag to start fresh."
        )
    return found


def save_failed(error: dist_ckpt.CheckpointError, root: str | Path, step: int) -> CheckpointError:
    """The one paragraph a run stops with when a checkpoint save failed: what failed, what is intact, the fix."""
    cause = error.__cause__ if isinstance(error, dist_ckpt.BackgroundSaveError) else error
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)  # the failed save is torn: not news
        intact = _as_given(root, dist_ckpt.latest(root))
    resume = (
        f"it resumes from {intact}, the newest complete checkpoint, which is intact"
        if intact is not None
        else "no checkpoint was complete before this one, so it starts from step 0"
    )
    if isinstance(cause, dist_ckpt.StorageError) and cause.reason == "full":
        what = f"the disk is full (writing {cause.url}: No space left on device)"
        fix = (
            f"Free space under {root}, or point trainer.checkpointer.base_path at a disk with room, or keep fewer "
            "checkpoints (trainer.checkpointer.keep)"
        )
    else:
        what = str(cause).rstrip(".")
        fix = "Fix that"
    return CheckpointError(
        f"Training stopped at step {step}: saving a checkpoint under {root} failed: {what}. The unfinished "
        f"checkpoint has no commit marker, so no run will ever load it. {fix}, then rerun the same command: {resume}."
    )


# Field names of the trainer state before lm-train 0.8 -> today's (a kind's checkpointed state was DoReMi's).
STATE_RENAMES = {"objective_state": "kind_state"}


def checkpoint_renames(config: TrainLmConfig) -> dict[str, str]:
    """Old names -> new of the state's and the model family's fields, so that checkpoints written before a rename
    still load (dist_ckpt uses them only where they turn the saved tree into the target's)."""
    return {**STATE_RENAMES, **getattr(type(config.model), "checkpoint_renames", {})}


def restore_state(path: str | Path, target: TrainerState, renames: dict[str, str] | None = None) -> TrainerState:
    """Load a checkpoint onto the state's sharded layout; a structure or shape mismatch is a clear error."""
    try:
        return dist_ckpt.load(path, target, renames=renames)
    except dist_ckpt.TreeMismatchError as e:
        raise CheckpointError(
            f"Checkpoint {path} does not fit this config's model: {e} Resume with the config that wrote it, or "
            "start a new run (another trainer.id or trainer.run_dir, or trainer.load_checkpoint: false)."
        ) from None


def restore_newest_intact(
    path: str | Path, target: TrainerState, config: TrainLmConfig, paths: RunPaths, *, is_main: bool
) -> tuple[TrainerState, str | Path]:
    """Resume from `path`; if it turns out damaged, quarantine it and fall back to the next newest intact one.

    A damaged checkpoint never leads to a silent restart from step 0: when none intact is left, or when the user
    named the checkpoint (trainer.load_checkpoint_path), it is a clear error instead.
    """
    explicit = bool(config.trainer.load_checkpoint_path)
    root = checkpoint_root(config, paths)
    while True:
        state, error = _restore_agreed(path, target, checkpoint_renames(config))
        if error is None:
            assert state is not None  # _restore_agreed gives a state exactly when it gives no error
            return state, path
        if explicit:
            raise CheckpointError(
                f"trainer.load_checkpoint_path: {error} Point it at an intact checkpoint (`dist-ckpt verify` or "
                "`lm-train checkpoints` lists them), or remove it to resume from the newest intact one."
            ) from None
        if is_main:
            moved = dist_ckpt.quarantine(path, reason=error)
            warnings.warn(f"{error} Quarantined it as {moved}; falling back to the previous checkpoint.", stacklevel=2)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("lm_train_quarantine")
        previous = _as_given(root, dist_ckpt.latest(root))
        if previous is None:
            raise CheckpointError(
                f"Every checkpoint under {root} is damaged (each was quarantined as step-N.corrupt); the last: "
                f"{error} Resuming would silently restart from step 0, so the run stops. Start fresh on purpose "
                "with trainer.load_checkpoint: false, or restore the checkpoints from a copy."
            )
        path = previous


def _restore_agreed(
    path: str | Path, target: TrainerState, renames: dict[str, str]
) -> tuple[TrainerState | None, BaseException | None]:
    """restore_state, where every process agrees whether it failed (each reads only its own part of the arrays)."""
    try:
        state, error = restore_state(path, target, renames), None
    except dist_ckpt.CorruptCheckpointError as e:
        state, error = None, e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = multihost_utils.process_allgather(np.int32(error is not None))
        if error is None and np.any(failed):
            error = dist_ckpt.CorruptCheckpointError(
                f"Checkpoint {path} is damaged (another process found it so).", path=str(path), file=str(path)
            )
    return state, error


def load_model_weights(
    checkpoint: str | Path,
    config: TrainLmConfig,
    plan: MeshPlan,
    Vocab: nt.Axis,
    *,
    progress: bool = False,
    weights: str = "raw",
) -> tuple[Any, int]:
    """The model of a checkpoint (no optimizer state is read or built) on the plan's layout, and its step;
    `weights="ema"`: with its trainable weights replaced by the checkpoint's weight average."""
    shapes = model_shapes(config, plan, Vocab)
    renames = checkpoint_renames(config)
    try:
        if has_adapters(shapes):  # a LoRA run checkpoints its adapters; the base is its initialize_from_hf
            model = load_lora_model(checkpoint, config, plan, shapes, progress=progress)
        else:
            model = dist_ckpt.load(checkpoint, shapes, subtree=".model", progress=progress, renames=renames)
        if weights == "ema":  # the average has the trainable weights' structure, shapes and shardings
            trained, _ = split_trainable(model)
            average = dist_ckpt.load(checkpoint, shapes_of(trained), subtree=AVERAGED, progress=progress)
            model = averaged_model(model, average)
    except dist_ckpt.TreeMismatchError as e:
        raise CheckpointError(f"Checkpoint {checkpoint} does not fit the config's model: {e}") from None
    return model, int(dist_ckpt.read_manifest(checkpoint).get("step", -1))


@dataclass
class LoadedModel:
    """A trained model with what is needed to use it."""

    config: TrainLmConfig
    model: Any
    tokenizer: Any
    step: int
    checkpoint: str | Path
    paths: RunPaths
    weights: str = "raw"
    """Which of the checkpoint's weights the model holds: `ema` (its weight average) or `raw`."""


def load_model(checkpoint: str | Path, weights: str | None = None) -> LoadedModel:
    """A checkpoint's model, with its run's config.yaml and tokenizer.json (for sample and export-hf); `weights`:
    `ema`, `raw`, or None for the run's choice (model_averaging.chosen_weights)."""
    import shard_cache
    from lm_train.config import load_train_config
    from lm_train.run.mesh import plan_mesh

    checkpoint = resolve_checkpoint(checkpoint)
    paths = RunPaths.of_checkpoint(checkpoint)
    config, _ = load_train_config([read_run_config(paths)])
    tokenizer = shard_cache.load_tokenizer(str(paths.tokenizer_file))
    Vocab = nt.Axis("vocab", tokenizer.get_vocab_size(with_added_tokens=True))
    chosen = chosen_weights(weights, checkpoint, dist_ckpt.read_manifest(checkpoint), config.trainer.model_averaging)
    model, step = load_model_weights(checkpoint, config, plan_mesh(config.trainer), Vocab, weights=chosen)
    return LoadedModel(config, model, tokenizer, step, checkpoint, paths, chosen)
