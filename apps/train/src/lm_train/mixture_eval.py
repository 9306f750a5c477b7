"""A mixture's evaluation: `eval/<name>/loss` for every source with validation data, and the weighted `eval/loss`.

`eval/loss` is the sum of the sources' losses times the training weights in force at the evaluated step
(normalised over the sources that were evaluated; equal weights if none of them is trained on at that step).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jmp

import named_tensors as nt
from lm_train.config.mixture_keys import mixture_schedule
from lm_train.config.schema import TrainLmConfig
from lm_train.data.batches import ProcessSlice, validation_batches
from lm_train.data.caches import PreparedData
from lm_train.data.mixture_data import MixtureData
from lm_train.errors import DataError
from lm_train.evaluation import Evaluator, loss_metrics
from lm_train.mesh import MeshPlan


def weighted_loss(losses: dict[str, float], weights: dict[str, float]) -> float:
    """Σ w·loss over the evaluated sources, the weights normalised over them (equal if they are all 0)."""
    total = sum(weights.get(name, 0.0) for name in losses)
    if total <= 0:
        return sum(losses.values()) / len(losses)
    return sum(weights.get(name, 0.0) / total * loss for name, loss in losses.items())


class MixtureEvaluator:
    """The validation loss of each source of a mixture, with one compiled eval step for all of them."""

    def __init__(
        self, config: TrainLmConfig, plan: MeshPlan, data: MixtureData, part: ProcessSlice, policy: jmp.Policy
    ):
        self.schedule = mixture_schedule(config.data)
        self.sources = {
            name: PreparedData(data.tokenizer_path, caches.train, caches.validation, [])
            for name, caches in data.sources.items()
            if caches.validation is not None
        }
        self.part = part
        first = next(iter(self.sources.values()), PreparedData(data.tokenizer_path, "", None, []))
        self._evaluator = Evaluator(config, plan, first, part, policy)
        self.batch_size = self._evaluator.batch_size

    @property
    def has_data(self) -> bool:
        return bool(self.sources)

    def source_losses(self, model: Any) -> dict[str, float]:
        """The mean next-token loss of each source with at least one full validation batch."""
        ev = self._evaluator
        losses = {}
        for name, source in self.sources.items():
            batches = validation_batches(source, ev.Pos.size, ev.batch_size, ev.max_batches, self.part)
            loss = ev.loss(model, batches)
            if loss is not None:
                losses[name] = loss
        return losses

    def metrics(self, model: Any, step: int) -> dict[str, float] | None:
        """`eval/<name>/loss` per source and the weighted `eval/loss` (with perplexity) after `step` steps."""
        losses = self.source_losses(model)
        if not losses:
            return None
        out = loss_metrics(weighted_loss(losses, self.schedule.weights_at(max(step - 1, 0))))
        out.update({f"eval/{name}/loss": loss for name, loss in losses.items()})
        return out


def evaluate_mixture_checkpoint(
    config: TrainLmConfig, checkpoint: str | Path | None = None, config_files: Sequence[Path] = ()
) -> tuple[dict[str, float], Path]:
    """`lm-train eval` of a mixture: every source's validation loss and the weighted one, of a checkpoint."""
    from lm_train.checkpoints import load_model_weights, resolve_checkpoint
    from lm_train.data.mixture_data import prepare_mixture_data
    from lm_train.distributed import initialize_distributed
    from lm_train.mesh import plan_mesh
    from lm_train.precision import parse_policy
    from lm_train.run_dir import RunPaths

    dist = initialize_distributed()
    paths = RunPaths.for_config(config, config_files)
    plan = plan_mesh(config.trainer)
    path = resolve_checkpoint(checkpoint if checkpoint is not None else paths.checkpoints)
    is_main = dist.process_index == 0
    data = prepare_mixture_data(config.data, background=False, progress=is_main, builder=is_main)
    model, step = load_model_weights(path, config, plan, nt.Axis("vocab", data.vocab_size()), progress=is_main)
    part = ProcessSlice(dist.process_index, dist.process_count)
    evaluator = MixtureEvaluator(config, plan, data, part, parse_policy(config.trainer.mp))
    if not evaluator.has_data:
        raise DataError("No source of the mixture has validation data: set data.configs.<name>.validation_urls.")
    metrics = evaluator.metrics(model, max(step, 0))
    if metrics is None:
        raise DataError(
            f"No source's validation data holds a full batch of {evaluator.batch_size} examples of "
            f"{config.model.Pos.size} tokens; lower trainer.train_batch_size (or trainer.per_device_eval_parallelism) "
            "or model.seq_len, or add validation text."
        )
    return metrics, path
