"""A kind of training as one plugin: the batch fields, extra state, objective, config checks and plan share it adds.

The loop, the state, the batch, the step and the planner know kinds only through `TrainingKind`; each kind (language
modelling, DPO, DoReMi) is one module that builds one, and `lm_train.kinds` is the table of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import named_tensors as nt
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import ConfigError
from lm_train.run.batch import CORE_FIELDS, BatchField
from lm_train.run.objectives import Objective
from lm_train.run.precision import parse_policy
from lm_train.run.preflight import RunSetup
from lm_train.run.start import starting_state
from lm_train.run.state import TrainerState, shapes_of
from lm_train.run.train_inputs import TrainInputs


def _no_checks(config: TrainLmConfig) -> None:
    return None


def _keeps_frozen(config: TrainLmConfig) -> str | None:
    return None


@dataclass(frozen=True)
class TrainingKind:
    """Everything one kind of training adds to the shared loop, under one interface."""

    command: str
    """Its command: `lm-train <command>` trains it, and `lm-train plan` names it so."""
    prepare_data: Callable[[RunSetup], Any]
    """The tokenizer and caches, builds started (an object with vocab_size(), stop_builds(), check_builds(), ...)."""
    inputs: Callable[[RunSetup, Any], TrainInputs]
    """Each step's batch, the evaluation and the data metrics, from the prepared data."""
    objective: Callable[[TrainLmConfig], Objective | None]
    """What the step differentiates, under the one signature of `Objective` (None: the next-token loss)."""
    batch_fields: Callable[[TrainLmConfig], tuple[str, ...]]
    """The fields of the run's batches, as the step is compiled and planned for them."""
    extra_fields: Mapping[str, BatchField] = field(default_factory=dict)
    """The fields it adds to CORE_FIELDS: their dtypes, and whether each is per token or per example."""
    check_config: Callable[[TrainLmConfig], None] = _no_checks
    """What it needs of the rest of the config, checked before anything starts (a ConfigError naming the key)."""
    initial_kind_state: Callable[[TrainLmConfig], Any] | None = None
    """The checkpointed state it carries from step to step, at step 0 (a pytree of arrays, replicated); a resumed run
    restores it from the checkpoint. None: no such state, and the checkpoint holds what a plain run's holds."""
    frozen_model: Callable[[RunSetup, nt.Axis], Any] | None = None
    """(setup, Vocab) -> a frozen model its objective compares against, in the compute dtype on the model's
    shardings; never checkpointed, so it is built the same way on a fresh start and on resume."""
    frozen_left_out: Callable[[TrainLmConfig], str | None] = _keeps_frozen
    """Why a run of this config keeps no frozen model although the kind has one (its frozen_model returns None then),
    as the plan notes it; None: it keeps one, and the plan counts it."""
    finish: Callable[[TrainLmConfig, Any], None] | None = None
    """Called on process 0 with the config and the TrainResult once the run reached its last step."""
    sequences_per_example: int = 1
    """Sequences of seq_len tokens in one example (pairs: 2), for tokens/s and the plan."""
    flops_scale: float = 1.0
    """Training FLOPs per token relative to one forward and backward pass of the model (for MFU and the plan)."""
    plan_note: str = ""
    """What the plan's heading says of this kind (e.g. that it trains on pairs)."""
    frozen_label: tuple[str, str] = ("frozen model", "(frozen, compute dtype)")
    """The plan's line for the frozen model: its name and its note."""
    sampling_memory: Callable[[TrainLmConfig, int, str], Any] | None = None
    """(config, vocabulary size, platform) -> what its sampling holds beside the train step, per device
    (planning.figures.SamplingMemory), for the plan; None: nothing."""
    batch_schedules: bool = False
    """Whether its data follows a batch-size schedule (trainer.train_batch_size as a list) and pads a batch that does
    not divide over the devices (trainer.allow_nondivisible_batch_size); a kind without refuses both."""

    @property
    def name(self) -> str:
        return f"lm-train {self.command}"

    def check_batch_sizes(self, config: TrainLmConfig, data_size: int) -> None:
        """A ConfigError naming the key unless this kind reads the batch sizes that the config asks for."""
        trainer = config.trainer
        if self.batch_schedules:
            return
        if trainer.batch_schedule.fixed is None:
            raise ConfigError(
                f"trainer.train_batch_size: {self.name} trains on one batch size, and this config gives a schedule "
                "of sizes (only `lm-train run` reads one). Give one number of examples per step."
            )
        if trainer.allow_nondivisible_batch_size and trainer.batch_schedule.fixed % data_size:
            raise ConfigError(
                f"trainer.allow_nondivisible_batch_size: {self.name} does not pad its batches (only `lm-train run` "
                f"does): give a trainer.train_batch_size that is a multiple of the {data_size} data-parallel devices."
            )

    @property
    def fields(self) -> Mapping[str, BatchField]:
        """Every field its batches may have."""
        return {**CORE_FIELDS, **self.extra_fields}

    def start(self, setup: RunSetup, data: Any) -> tuple[TrainerState, TrainerState]:
        """The state to train from (resumed, fresh or from HF) with the kind's state and frozen model, and the
        target shapes of its layout."""
        kind_state = None
        if self.initial_kind_state is not None:
            if setup.step_settings.microbatches != 1:
                raise ConfigError(
                    f"trainer.per_device_parallelism: {self.name} updates its state from the whole batch at once, so "
                    "it cannot accumulate microbatches; set per_device_parallelism to train_batch_size / devices."
                )
            replicated = NamedSharding(setup.plan.mesh, PartitionSpec())
            kind_state = jax.device_put(self.initial_kind_state(setup.config), replicated)
        state, target = starting_state(setup, data, kind_state=kind_state)
        if self.frozen_model is None:
            return state, target
        frozen = self.frozen_model(setup, nt.Axis("vocab", data.vocab_size()))
        # The checkpoint holds no frozen model: the state was restored without one, and gets it here.
        return dataclasses.replace(state, frozen=frozen), dataclasses.replace(target, frozen=shapes_of(frozen))

    def planned_state(self, state: Any, config: TrainLmConfig, replicated: Any = None) -> Any:
        """The state's shapes (`state_structure` or `state_shapes`) with what this kind adds: its kind state
        (`replicated`: the sharding to give it, if any) and its frozen model, the model's floating arrays in the
        compute dtype on the same shardings (none where frozen_left_out says why)."""
        initial = self.initial_kind_state
        if initial is not None:
            shapes = jax.eval_shape(lambda: initial(config))
            if replicated is not None:
                shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shapes)
            state = dataclasses.replace(state, kind_state=shapes)
        if self.frozen_model is None or self.frozen_left_out(config) is not None:
            return state
        compute = parse_policy(config.trainer.mp).compute_dtype

        def cast(x: Any) -> Any:
            if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating):
                return jax.ShapeDtypeStruct(x.shape, compute, sharding=x.sharding)
            return x

        return dataclasses.replace(state, frozen=jax.tree.map(cast, state.model))
