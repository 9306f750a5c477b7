"""`lm-train plan --compile`: XLA's own memory analysis of the run's train step, compiled on the devices present."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from jax.sharding import NamedSharding, PartitionSpec

import named_tensors as nt
from lm_train.config.schema import TrainLmConfig
from lm_train.kinds import training_kind
from lm_train.optim import build_optimizer
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.mesh import check_batch_fits, plan_mesh
from lm_train.run.state import state_shapes
from lm_train.run.step import StepSettings, make_train_step

if TYPE_CHECKING:
    from lm_train.run.training_kind import TrainingKind


def xla_memory(
    config: TrainLmConfig, vocab_size: int, devices: list[jax.Device] | None = None, kind: TrainingKind | None = None
) -> dict[str, int]:
    """Compile the run's train step (of `kind`, default `lm-train run`'s) on `devices` (default: all present) and
    read XLA's memory analysis of one.

    The peak is arguments + outputs not aliased to them + XLA's temporary allocation.
    """
    kind = kind or training_kind()
    trainer = config.trainer
    plan = plan_mesh(trainer, devices)
    Vocab = nt.Axis("vocab", vocab_size)
    optimizer, schedule = build_optimizer(config.optimizer, trainer.num_train_steps)
    settings = StepSettings.of_config(config, check_batch_fits(trainer, plan, 1))
    replicated = NamedSharding(plan.mesh, PartitionSpec())
    target = kind.planned_state(state_shapes(config, plan, Vocab, optimizer), config, replicated)
    train_step = make_train_step(optimizer, settings, schedule, objective=kind.objective(config))
    step = CompiledStep(train_step, StateLayout(target), plan, config.model.Pos, trainer.batch_axis, kind.fields)
    analysis = step.lower(target, trainer.train_batch_size, kind.batch_fields(config)).compile().memory_analysis()
    figures = {
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
        "temp_bytes": int(analysis.temp_size_in_bytes),
    }
    figures["peak_bytes"] = (
        figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"] + figures["temp_bytes"]
    )
    return figures
