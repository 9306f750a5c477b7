"""Validation loss: the eval step, a pass over each source's validation batches, and `lm-train eval`.

A single source's `eval/loss` is its mean loss. A mixture also logs `eval/<name>/loss` for every source with
validation data, and its `eval/loss` is the sum of the sources' losses times the training weights in force at the
evaluated step (normalised over the sources that were evaluated; equal weights if none of them is trained on at
that step).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np

import named_tensors as nt
from lm_models import inference_mode, next_token_loss, next_token_targets
from lm_train.config.batch_sizes import padded
from lm_train.config.mixture_keys import data_schedule
from lm_train.config.schema import TrainLmConfig
from lm_train.data.batches import ProcessSlice, validation_batches
from lm_train.data.caches import PreparedData
from lm_train.data.sft_data import example_view
from lm_train.errors import DataError
from lm_train.run.batch import TokenBatch, as_host_batch, named_batch
from lm_train.run.mesh import MeshPlan


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
    """Examples per evaluation batch: per_device_eval_parallelism per data-parallel device, else the largest train
    batch (rounded up to a multiple of the data-parallel devices where trainer.allow_nondivisible_batch_size)."""
    per_device = config.trainer.per_device_eval_parallelism
    if per_device != -1:
        return per_device * plan.data_size
    largest = config.trainer.batch_schedule.largest
    return padded(largest, plan.data_size) if config.trainer.allow_nondivisible_batch_size else largest


def weighted_loss(losses: dict[str, float], weights: dict[str, float]) -> float:
    """Σ w·loss over the evaluated sources, the weights normalised over them (equal if they are all 0)."""
    total = sum(weights.get(name, 0.0) for name in losses)
    if total <= 0:
        return sum(losses.values()) / len(losses)
    return sum(weights.get(name, 0.0) / total * loss for name, loss in losses.items())


class Evaluator:
    """Mean next-token loss of a model over each source's validation data, on the run's mesh, with one compiled
    eval step for all of them."""

    def __init__(
        self, config: TrainLmConfig, plan: MeshPlan, data: PreparedData, part: ProcessSlice, policy: jmp.Policy
    ):
        self.plan = plan
        self.part = part
        self.mixture = config.data.is_mixture
        self.schedule = data_schedule(config.data)
        self.sources = {name: c.validation for name, c in data.sources.items() if c.validation is not None}
        self.Pos = config.model.Pos
        self.batch_axis = config.trainer.batch_axis
        self.batch_size = eval_batch_size(config, plan)
        self.max_batches = config.trainer.max_eval_batches
        self.examples = example_view(config.data)
        self._step = eqx.filter_jit(make_eval_step(policy))

    @property
    def has_data(self) -> bool:
        return bool(self.sources)

    def source_batches(self, name: str) -> Iterator[np.ndarray | dict[str, np.ndarray]]:
        """One pass over a source's validation data (this process's rows of each global batch)."""
        cache = self.sources[name]
        return validation_batches(cache, self.Pos.size, self.batch_size, self.max_batches, self.part, self.examples)

    def batches(self) -> Iterable[np.ndarray | dict[str, np.ndarray]]:
        """Every source's validation batches, source after source."""
        return itertools.chain.from_iterable(self.source_batches(name) for name in self.sources)

    def _device_batch(self, local: np.ndarray | dict[str, np.ndarray]) -> TokenBatch:
        arrays = {
            name: jax.make_array_from_process_local_data(
                self.plan.batch_sharding() if value.ndim == 2 else self.plan.example_sharding(), value
            )
            for name, value in as_host_batch(local).items()
        }
        return named_batch(arrays, self.batch_axis, self.Pos)

    def loss(self, model: Any, batches: Iterable[np.ndarray | dict[str, np.ndarray]] | None = None) -> float | None:
        """The mean loss per predicted token, or None when there is no full validation batch.

        `batches` (default: every source's validation data) lets one compiled eval step serve other data too.
        """
        total, count = 0.0, 0.0
        with nt.axis_mapping(self.plan.compute_mapping, mesh=self.plan.mesh):
            for local in self.batches() if batches is None else batches:
                s, c = self._step(model, self._device_batch(local))
                total += float(s)
                count += float(c)
        return total / count if count else None

    def source_losses(self, model: Any) -> dict[str, float]:
        """The mean next-token loss of each source with at least one full validation batch."""
        losses = {name: self.loss(model, self.source_batches(name)) for name in self.sources}
        return {name: loss for name, loss in losses.items() if loss is not None}

    def metrics(self, model: Any, step: int) -> dict[str, float] | None:
        """`eval/loss` (with perplexity) after `step` steps and, for a mixture, `eval/<name>/loss` per source;
        None without a full validation batch."""
        losses = self.source_losses(model)
        if not losses:
            return None
        out = loss_metrics(weighted_loss(losses, self.schedule.weights_at(max(step - 1, 0))))
        if self.mixture:
            out.update({f"eval/{name}/loss": loss for name, loss in losses.items()})
        return out


def loss_metrics(loss: float) -> dict[str, float]:
    """`eval/loss` and `eval/perplexity` (capped, so a diverged run logs a number)."""
    return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}


def evaluate_checkpoint(
    config: TrainLmConfig,
    checkpoint: str | Path | None = None,
    config_files: Sequence[Path] = (),
    weights: str | None = None,
) -> tuple[dict[str, float], str | Path, str]:
    """`eval/loss` (and perplexity; a mixture's per source too) of a checkpoint's `weights` (ema, raw, or None for
    the run's choice) over the whole validation data, which checkpoint it was and which weights."""
    import dist_ckpt
    from lm_train.data.caches import prepare_data
    from lm_train.run.checkpoints import load_model_weights, resolve_checkpoint
    from lm_train.run.distributed import initialize_distributed
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.model_averaging import check_weights, chosen_weights
    from lm_train.run.precision import parse_policy
    from lm_train.run.run_dir import RunPaths

    check_weights(weights)
    dist = initialize_distributed()
    paths = RunPaths.for_config(config, config_files)
    plan = plan_mesh(config.trainer)
    path = resolve_checkpoint(checkpoint if checkpoint is not None else paths.checkpoints)
    chosen = chosen_weights(weights, path, dist_ckpt.read_manifest(path), config.trainer.model_averaging)
    is_main = dist.process_index == 0
    data = prepare_data(config.data, background=False, progress=is_main, builder=is_main)
    mixture = config.data.is_mixture
    if not any(caches.validation for caches in data.sources.values()):
        raise DataError(
            "No source of the mixture has validation data: set data.configs.<name>.validation_urls."
            if mixture
            else "The config has no validation data: set data.validation_urls (or use data.builtin)."
        )
    Vocab = nt.Axis("vocab", data.vocab_size())
    model, step = load_model_weights(path, config, plan, Vocab, progress=is_main, weights=chosen)
    part = ProcessSlice(dist.process_index, dist.process_count)
    evaluator = Evaluator(config, plan, data, part, parse_policy(config.trainer.mp))
    metrics = evaluator.metrics(model, max(step, 0))
    if metrics is None:
        whose = "No source's validation data holds a" if mixture else "The validation data holds no"
        raise DataError(
            f"{whose} full batch of {evaluator.batch_size} examples of {config.model.Pos.size} tokens; lower "
            "trainer.train_batch_size (or trainer.per_device_eval_parallelism) or model.seq_len, or add validation "
            "text."
        )
    return metrics, path, chosen
