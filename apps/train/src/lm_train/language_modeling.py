"""`lm-train run`: language modelling (pretraining, SFT, LoRA) as a training kind: next-token loss, no extra state."""

from __future__ import annotations

from typing import Any

from lm_train.config.schema import TrainLmConfig
from lm_train.data.caches import prepare_data
from lm_train.data.sft_data import example_fields
from lm_train.post.lora_training import run_objective
from lm_train.run.console import current_console
from lm_train.run.objectives import Objective
from lm_train.run.preflight import RunSetup
from lm_train.run.train_inputs import train_inputs
from lm_train.run.training_kind import TrainingKind


def prepare_text_data(setup: RunSetup) -> Any:
    """The tokenizer and caches of the config's data (a single source is a mixture of one), builds started."""
    shown = current_console()  # the run's live display, where the cache bars join the training bar
    progress = shown.cache_display() if shown is not None else setup.is_main
    return prepare_data(setup.config.data, background=True, progress=progress, builder=setup.is_main)


def _objective(config: TrainLmConfig) -> Objective | None:
    return run_objective(config)  # None (the step's next-token loss) unless LoRA adapters use dropout


def _fields(config: TrainLmConfig) -> tuple[str, ...]:
    """Packed rows bring segment ids, positions and a loss mask, which decide the attention kernels and the
    batch's bytes; a mixture's batches hold ids alone."""
    return ("input_ids",) if config.data.is_mixture else example_fields(config.data)


LANGUAGE_MODELING = TrainingKind(
    command="run",
    prepare_data=prepare_text_data,
    inputs=train_inputs,
    objective=_objective,
    batch_fields=_fields,
    batch_schedules=True,
)
