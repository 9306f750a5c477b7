"""`lm-train eval`: the validation loss of a checkpoint on a config's validation data."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import equinox as eqx

import dist_ckpt
import named_tensors as nt
from lm_train.checkpoint_io import resolve_checkpoint
from lm_train.config import TrainLmConfig
from lm_train.data.pipeline import prepare_data, validation_batches
from lm_train.distributed import initialize_distributed
from lm_train.errors import CheckpointError, DataError
from lm_train.mesh import plan_mesh
from lm_train.optim import build_optimizer
from lm_train.precision import parse_policy
from lm_train.run_dir import RunPaths
from lm_train.step import make_eval_step


def evaluate_checkpoint(
    config: TrainLmConfig, checkpoint: Path | None = None, config_files: Sequence[Path] = ()
) -> dict[str, float]:
    """Mean next-token loss (and perplexity) of a checkpoint over the whole validation set."""
    from lm_train.trainer import evaluate, state_shapes

    dist = initialize_distributed()
    paths = RunPaths.for_config(config, config_files)
    path = resolve_checkpoint(checkpoint if checkpoint is not None else paths.checkpoints)
    data = prepare_data(
        config.data, background=False, progress=dist.process_index == 0, builder=dist.process_index == 0
    )
    if data.validation_cache is None:
        raise DataError("The config has no validation data: set data.validation_urls (or use data.builtin).")
    Vocab = nt.Axis("vocab", data.vocab_size())
    plan = plan_mesh(config.trainer)
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    target = state_shapes(config, plan, Vocab, optimizer)
    try:
        model = dist_ckpt.load(path, target.model, subtree=".model", progress=dist.process_index == 0)
    except dist_ckpt.TreeMismatchError as e:
        raise CheckpointError(f"Checkpoint {path} does not fit this config's model: {e}") from None
    Pos = config.model.Pos
    eval_step = eqx.filter_jit(make_eval_step(parse_policy(config.trainer.mp)))
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        loss = evaluate(
            model,
            eval_step,
            validation_batches(
                data,
                Pos.size,
                config.trainer.train_batch_size,
                config.trainer.max_eval_batches,
                dist.process_index,
                dist.process_count,
            ),
            plan,
            Pos,
            config.trainer.batch_axis,
        )
    if loss is None:
        raise DataError(
            f"The validation data holds no full batch of {config.trainer.train_batch_size} examples of "
            f"{Pos.size} tokens; lower trainer.train_batch_size or model.seq_len, or add validation text."
        )
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
