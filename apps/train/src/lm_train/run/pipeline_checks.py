"""Checks of a pipeline-parallel run's config against its model and mesh, before anything compiles."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

import named_tensors as nt
from lm_train.config.batch_sizes import padded, size_where
from lm_train.config.trainer_config import TrainerConfig
from lm_train.errors import ConfigError
from lm_train.run.mesh import MeshPlan
from lm_train.run.pipeline import pipeline_schedule

if TYPE_CHECKING:
    from lm_train.config.schema import TrainLmConfig


def check_pipeline(config: TrainLmConfig, plan: MeshPlan, accumulation: int) -> None:
    """A clear ConfigError, naming the key, unless the model's layers and the batch split into the run's stages and
    microbatches (`accumulation`: the gradient-accumulation microbatches of a step, each pipelined on its own)."""
    schedule = pipeline_schedule(config.trainer)
    if schedule is None:
        return
    stages = schedule.stages
    model = jax.eval_shape(lambda: config.model.build(nt.Axis("vocab", config.data.vocab_size), key=jax.random.key(0)))
    stack = model.layer_stack()
    family = config.model.model_type
    if stack is None:
        raise ConfigError(
            f"trainer.pipeline_axis_size={stages}: model.type {family} exposes no layer stack to split into stages; "
            "pipeline parallelism runs the decoder families (llama, mistral, qwen, ...) and gpt2. Set "
            "trainer.pipeline_axis_size to 1 for this model."
        )
    if not isinstance(stack, nt.Stacked):
        raise ConfigError(
            f"trainer.pipeline_axis_size={stages}: the stages split a scanned layer stack, and this model's layers "
            "are unrolled. Set model.scan_layers to true (a model mixing dense and sparse layers cannot scan them: "
            "train it without pipeline parallelism)."
        )
    if _aux_losses(config.model):
        raise ConfigError(
            f"trainer.pipeline_axis_size={stages}: model.type {family} has auxiliary losses per layer (a mixture of "
            "experts' router losses), which the pipeline does not carry. Set trainer.pipeline_axis_size to 1."
        )
    layers = stack.Layers.size
    if layers % stages:
        raise ConfigError(
            f"model.num_layers={layers} does not split into trainer.pipeline_axis_size={stages} stages of equal "
            f"size. Use a number of stages that divides {layers}, or a multiple of {stages} layers."
        )
    check_pipeline_batch(config.trainer, plan.data_size, accumulation)


def check_pipeline_batch(trainer: TrainerConfig, data_size: int, accumulation: int) -> None:
    """A clear ConfigError unless each accumulation microbatch splits into the pipeline's microbatches over the
    `data_size` data-parallel devices."""
    schedule = pipeline_schedule(trainer)
    if schedule is None:
        return
    micro, sizes = schedule.microbatches, trainer.batch_schedule
    for size in sizes.distinct_sizes:
        padded_size = padded(size, data_size) if trainer.allow_nondivisible_batch_size else size
        rows = sizes.largest // accumulation if accumulation > 1 else padded_size
        if rows % (micro * data_size):
            where = f" (each of the {accumulation} accumulation microbatches)" if accumulation > 1 else ""
            raise ConfigError(
                f"{size_where(sizes, size)}{where} does not split into "
                f"trainer.pipeline.microbatches={micro} microbatches over the {data_size} data-parallel devices: "
                f"{rows} rows need to be a multiple of {micro} x {data_size} = {micro * data_size}. Change "
                "trainer.pipeline.microbatches or the batch size."
            )


def _aux_losses(model_config: Any) -> bool:
    weights = getattr(model_config, "aux_loss_weights", None)
    return bool(weights()) if callable(weights) else False
