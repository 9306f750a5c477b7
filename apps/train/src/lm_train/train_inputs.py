"""What the training loop reads and evaluates, for one source or a mixture: the same four things either way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lm_train.data.batches import TrainBatches
from lm_train.data.caches import PreparedData
from lm_train.data.mixture_batches import MixtureBatches
from lm_train.data.mixture_data import MixtureData
from lm_train.data.sft_data import DataSummary, example_fields, example_view
from lm_train.evaluation import Evaluator, loss_metrics
from lm_train.mixture_eval import MixtureEvaluator
from lm_train.preflight import RunSetup


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


def _single_source(setup: RunSetup, data: PreparedData) -> TrainInputs:
    config, t = setup.config, setup.config.trainer
    view = example_view(config.data)
    Pos = config.model.Pos
    batches = TrainBatches(data, Pos.size, t.train_batch_size, t.seed, config.data.shuffle, setup.part, view)
    evaluator = Evaluator(config, setup.plan, data, setup.part, setup.policy)

    def evaluate(model: Any, step: int) -> dict[str, float] | None:
        loss = evaluator.loss(model)
        return None if loss is None else loss_metrics(loss)

    fields = example_fields(config.data)
    return TrainInputs(batches.batch, fields, evaluate, evaluator.has_data, lambda step: {}, batches.summary)


def mixture_inputs(setup: RunSetup, data: MixtureData, with_sources: bool = False) -> TrainInputs:
    """A mixture's inputs; `with_sources`: each batch also holds every example's source (`source_ids`)."""
    config, t = setup.config, setup.config.trainer
    batches = MixtureBatches.from_caches(
        data, config.data, config.model.Pos.size, t.train_batch_size, t.seed, setup.part
    )
    evaluator = MixtureEvaluator(config, setup.plan, data, setup.part, setup.policy)
    batch, fields = (
        (batches.batch_with_sources, ("input_ids", "source_ids")) if with_sources else (batches.batch, ("input_ids",))
    )
    return TrainInputs(batch, fields, evaluator.metrics, evaluator.has_data, batches.data_metrics)


def train_inputs(setup: RunSetup, data: PreparedData | MixtureData) -> TrainInputs:
    """The loop's inputs for the run's data: a mixture's, or one source's."""
    if isinstance(data, MixtureData):
        return mixture_inputs(setup, data)
    return _single_source(setup, data)
