"""What one kind of training (`lm-train run`, `lm-train dpo`) gives the shared loop: data, state, inputs, objective."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lm_train.data.caches import prepare_any_data
from lm_train.lora_training import run_objective
from lm_train.objectives import Objective
from lm_train.preflight import RunSetup
from lm_train.run_console import current_console
from lm_train.start import starting_state
from lm_train.state import TrainerState
from lm_train.train_inputs import TrainInputs, train_inputs


def _language_model_data(setup: RunSetup) -> Any:
    data = setup.config.data
    shown = current_console()  # the run's live display, where the cache bars join the training bar
    progress = shown.cache_display() if shown is not None else setup.is_main
    return prepare_any_data(data, background=True, progress=progress, builder=setup.is_main)


def _run_objective(setup: RunSetup) -> Objective | None:
    return run_objective(setup.config)  # None (the step's next-token loss) unless LoRA adapters use dropout


@dataclass(frozen=True)
class TrainingKind:
    """The parts of a run that differ between kinds of training; the defaults are `lm-train run`'s."""

    prepare_data: Callable[[RunSetup], Any] = _language_model_data
    """The tokenizer and caches (PreparedData or MixtureData), builds started."""
    start: Callable[[RunSetup, Any], tuple[TrainerState, Any]] = starting_state
    """The starting state on its sharded layout, and the target shapes of that layout."""
    inputs: Callable[[RunSetup, Any], TrainInputs] = train_inputs
    objective: Callable[[RunSetup], Objective | None] = _run_objective
    """What the step differentiates (None: the next-token loss with z_loss_weight)."""
    sequences_per_example: int = 1
    """Sequences of seq_len tokens in one example (DPO: 2), for tokens/s."""
    flops_scale: float = 1.0
    """Training FLOPs per token relative to one forward and backward pass of the model (for MFU)."""


LANGUAGE_MODELING = TrainingKind()
