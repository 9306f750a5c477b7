"""What the training loop reads and evaluates: the batches of each step, the evaluation and the data metrics of
the run's sources (one source, or a mixture)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lm_train.config.batch_sizes import padding_multiple
from lm_train.data.batches import TrainBatches
from lm_train.data.caches import PreparedData
from lm_train.data.sft_data import DataSummary, example_fields, example_view
from lm_train.run.evaluation import Evaluator
from lm_train.run.model_averaging import averaged_model
from lm_train.run.preflight import RunSetup

if TYPE_CHECKING:
    import trackers
    from lm_train.config.trainer_config import ModelAveragingConfig
    from lm_train.run.progress import TrainingProgress
    from lm_train.run.state import TrainerState


@dataclass
class TrainInputs:
    """This process's batch of each step, the evaluation, and the data metrics logged at log steps."""

    batch: Callable[[int], Any]
    """step -> this process's rows (an int32 array of ids, or a dict of batch fields)."""
    fields: tuple[str, ...]
    """The batch fields, for compiling the step ahead of the first batch."""
    evaluate: Callable[[Any, int], dict[str, float] | None]
    """(model, steps done) -> eval metrics with `eval/loss`, or None without a full validation batch."""
    has_eval: bool
    data_metrics: Callable[[int], dict[str, float]]
    """steps done -> host-side data metrics (a mixture's `data/<name>/...`; none for one source)."""
    summary: Callable[[], DataSummary | None] = lambda: None
    """What the training data held and left out (packing, truncation, skipped records), at the end of a run."""
    rollout: Callable[[int, Any, Any], Any] | None = None
    """(step, what `batch` gave, the current state) -> the step's rows, for kinds that sample their batch from the
    model being trained (RL); None: `batch` gives the rows."""
    rows: Callable[[int], int] | None = None
    """step -> the rows of its global batch as the step gets them (a batch-size schedule's size, padded where it
    does not divide over the devices); None: trainer.train_batch_size."""

    def evaluate_and_log(
        self,
        state: TrainerState,
        tracker: trackers.Tracker,
        step: int,
        last: float | None,
        bar: TrainingProgress,
        averaging: ModelAveragingConfig | None = None,
    ) -> float | None:
        """Evaluate (the averaged weights too, where the run keeps them), log it; the eval loss, else `last`."""
        metrics = self.evaluate(state.model, step)
        if metrics is None:
            return last
        if state.averaged is not None and averaging is not None and averaging.eval_ema:
            averaged = self.evaluate(averaged_model(state.model, state.averaged), step) or {}
            metrics.update({key.replace("eval/", "eval/ema/", 1): value for key, value in averaged.items()})
        tracker.log(metrics, step=step)
        bar.evaluated(step, metrics)
        return metrics.get("eval/loss", last)  # RL evaluates rewards, not a loss


def mixture_inputs(setup: RunSetup, data: PreparedData, with_sources: bool = False) -> TrainInputs:
    """The loop's inputs for the run's data; `with_sources`: each batch also holds every example's source
    (`source_ids`)."""
    config, t = setup.config, setup.config.trainer
    view = example_view(config.data)
    pad_to = padding_multiple(setup.plan.data_size, setup.dist.process_count) if t.allow_nondivisible_batch_size else 1
    batches = TrainBatches.from_caches(
        data, config.data, config.model.Pos.size, t.batch_schedule, t.seed, setup.part, view, pad_to
    )
    evaluator = Evaluator(config, setup.plan, data, setup.part, setup.policy)
    fields = example_fields(config.data)
    if batches.pads and "loss_mask" not in fields:  # padded rows are masked out of the loss
        fields = (*fields, "loss_mask")
    batch = batches.batch_with_sources if with_sources else batches.batch
    fields = (*fields, "source_ids") if with_sources else fields
    return TrainInputs(
        batch,
        fields,
        evaluator.metrics,
        evaluator.has_data,
        batches.data_metrics,
        batches.summary,
        rows=batches.rows,
    )


def train_inputs(setup: RunSetup, data: PreparedData) -> TrainInputs:
    """The loop's inputs for the run's data, a mixture's or one source's."""
    return mixture_inputs(setup, data)
