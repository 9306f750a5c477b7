"""Validation loss: the eval step, a pass over the validation batches, and `lm-train eval` on a checkpoint."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np

import named_tensors as nt
from lm_models import inference_mode, next_token_loss, next_token_targets
from lm_train.batch import TokenBatch, as_host_batch, named_batch
from lm_train.config.schema import TrainLmConfig
from lm_train.data.batches import ProcessSlice, validation_batches
from lm_train.data.caches import PreparedData
from lm_train.data.sft_data import example_view
from lm_train.errors import DataError
from lm_train.mesh import MeshPlan


def make_eval_step(policy: jmp.Policy) -> Callable[[Any, TokenBatch], tuple[jax.Array, jax.Array]]:
    """A function (model, batch) -> summed next-token loss and the number of scored tokens, in inference mode."""

    def eval_step(model: Any, batch: TokenBatch) -> tuple[jax.Array, jax.Array]:
        model = policy.cast_to_compute(inference_mode(model))
        ids = nt.shard(batch.input_ids)
        total = next_token_loss(model, ids, reduction="sum", **batch.loss_inputs())
        total = total.array if isinstance(total, nt.NamedArray) else total
        _, scored = next_token_targets(ids)
        if batch.loss_mask is not None:
            scored = scored & batch.loss_mask
        count = nt.sum(nt.broadcast_to(scored, ids.axes).astype(jnp.float32)).array
        return total.astype(jnp.float32), count

    return eval_step


def eval_batch_size(config: TrainLmConfig, plan: MeshPlan) -> int:
    """Examples per evaluation batch: per_device_eval_parallelism per data-parallel device, else the train batch."""
    per_device = config.trainer.per_device_eval_parallelism
    return config.trainer.train_batch_size if per_device == -1 else per_device * plan.data_size


class Evaluator:
    """Mean next-token loss of a model over the validation data, on the run's mesh."""

    def __init__(
        self, config: TrainLmConfig, plan: MeshPlan, data: PreparedData, part: ProcessSlice, policy: jmp.Policy
    ):
        self.plan = plan
        self.data = data
        self.part = part
        self.Pos = config.model.Pos
        self.batch_axis = config.trainer.batch_axis
        self.batch_size = eval_batch_size(config, plan)
        self.max_batches = config.trainer.max_eval_batches
        self.examples = example_view(config.data)
        self._step = eqx.filter_jit(make_eval_step(policy))

    @property
    def has_data(self) -> bool:
        return self.data.validation_cache is not None

    def batches(self) -> Iterable[np.ndarray]:
        return validation_batches(self.data, self.Pos.size, self.batch_size, self.max_batches, self.part, self.examples)

    def _device_batch(self, local: np.ndarray | dict[str, np.ndarray]) -> TokenBatch:
        arrays = {
            name: jax.make_array_from_process_local_data(
                self.plan.batch_sharding() if value.ndim == 2 else self.plan.example_sharding(), value
            )
            for name, value in as_host_batch(local).items()
        }
        return named_batch(arrays, self.batch_axis, self.Pos)

    def loss(self, model: Any, batches: Iterable[np.ndarray] | None = None) -> float | None:
        """The mean loss per predicted token, or None when there is no full validation batch.

        `batches` (default: this evaluator's validation data) lets one compiled eval step serve other data too.
        """
        total, count = 0.0, 0.0
        with nt.axis_mapping(self.plan.compute_mapping, mesh=self.plan.mesh):
            for local in self.batches() if batches is None else batches:
                s, c = self._step(model, self._device_batch(local))
                total += float(s)
                count += float(c)
        return total / count if count else None


def loss_metrics(loss: float) -> dict[str, float]:
    """`eval/loss` and `eval/perplexity` (capped, so a diverged run logs a number)."""
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def evaluate_checkpoint(
    config: TrainLmConfig, checkpoint: str | Path | None = None, config_files: Sequence[Path] = ()
) -> tuple[dict[str, float], Path]:
    """Mean next-token loss (and perplexity) of a checkpoint over the whole validation set, and which one it was."""
    from lm_train.checkpoints import load_model_weights, resolve_checkpoint
    from lm_train.data.caches import prepare_data
    from lm_train.distributed import initialize_distributed
    from lm_train.mesh import plan_mesh
    from lm_train.precision import parse_policy
    from lm_train.run_dir import RunPaths

    dist = initialize_distributed()
    paths = RunPaths.for_config(config, config_files)
    plan = plan_mesh(config.trainer)
    path = resolve_checkpoint(checkpoint if checkpoint is not None else paths.checkpoints)
    is_main = dist.process_index == 0
    data = prepare_data(config.data, background=False, progress=is_main, builder=is_main)
    if data.validation_cache is None:
        raise DataError("The config has no validation data: set data.validation_urls (or use data.builtin).")
    model, _ = load_model_weights(path, config, plan, nt.Axis("vocab", data.vocab_size()), progress=is_main)
    evaluator = Evaluator(
        config, plan, data, ProcessSlice(dist.process_index, dist.process_count), parse_policy(config.trainer.mp)
    )
    loss = evaluator.loss(model)
    if loss is None:
        raise DataError(
            f"The validation data holds no full batch of {evaluator.batch_size} examples of {config.model.Pos.size} "
            "tokens; lower trainer.train_batch_size (or trainer.per_device_eval_parallelism) or model.seq_len, or "
            "add validation text."
        )
    return loss_metrics(loss), path
