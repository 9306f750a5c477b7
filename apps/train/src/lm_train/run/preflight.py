"""Everything about a run that can be decided and checked before any data is read or Ray is started.

A config error then costs a second, not a tokenizer training, a cache build and a checkpoint restore.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jmp

import named_tensors as nt
from lm_models import SCAN_UNROLL_AUTO, resolve_scan_unroll
from lm_train.config.mixture_keys import mixture_schedule
from lm_train.config.optimizer_config import ScheduleConfig
from lm_train.config.schema import TrainLmConfig
from lm_train.data.batches import ProcessSlice
from lm_train.data.record_formats import check_data_format
from lm_train.errors import ConfigError
from lm_train.optim import Optimizer, build_optimizer
from lm_train.post.lora_training import check_lora, lora_base_as_absolute_path
from lm_train.run.checkpoints import find_resume_checkpoint
from lm_train.run.context_parallel import check_context, context_size
from lm_train.run.distributed import DistributedInfo
from lm_train.run.evaluation import eval_batch_size
from lm_train.run.mesh import MeshPlan, check_batch_fits, plan_mesh
from lm_train.run.pipeline_checks import check_pipeline
from lm_train.run.precision import parse_policy, with_resolved_mp
from lm_train.run.quantization import check_quantization
from lm_train.run.run_dir import RunPaths
from lm_train.run.step import StepSettings


@dataclass(frozen=True)
class RunSetup:
    """The decisions of a run that need no data: where it lives, its mesh, its step, where it resumes from."""

    config: TrainLmConfig
    dist: DistributedInfo
    paths: RunPaths
    plan: MeshPlan
    policy: jmp.Policy
    step_settings: StepSettings
    optimizer: Optimizer
    schedule: Any
    resume_from: str | Path | None

    @property
    def is_main(self) -> bool:
        return self.dist.process_index == 0

    @property
    def part(self) -> ProcessSlice:
        """This process's share of each global batch."""
        return ProcessSlice(self.dist.process_index, self.dist.process_count)


def _check_eval_batch(config: TrainLmConfig, plan: MeshPlan, process_count: int) -> None:
    size = eval_batch_size(config, plan)
    if size % process_count or size % plan.data_size:
        raise ConfigError(
            f"trainer.per_device_eval_parallelism={config.trainer.per_device_eval_parallelism} gives evaluation "
            f"batches of {size} examples, which do not divide over {process_count} processes and "
            f"{plan.data_size} data-parallel devices."
        )


def _check_model_builds(config: TrainLmConfig) -> None:
    """Trace the model's construction (shapes only, no memory) to catch a bad combination of model keys now."""
    try:
        shapes = jax.eval_shape(
            lambda: config.model.build(nt.Axis("vocab", config.data.vocab_size), key=jax.random.key(0))
        )
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: this model cannot be built: {e}. Fix the model keys in the config.") from None
    check_quantization(shapes, config.trainer.quantization)


def _check_hf_source(config: TrainLmConfig) -> None:
    source = config.initialize_from_hf
    if source is True:
        raise ConfigError(
            "initialize_from_hf: true asks for Levanter's default hub checkpoint of the model type, and lm-train "
            "downloads nothing from the hub. Set initialize_from_hf to the model's local Hugging Face directory."
        )
    if config.use_hf_model_config and not source:
        raise ConfigError(
            "use_hf_model_config: true takes the model section from initialize_from_hf's config.json; set "
            "initialize_from_hf to a local Hugging Face directory, or remove use_hf_model_config."
        )
    if not 0.0 <= config.fcm_prob < 1.0:
        raise ConfigError(f"fcm_prob: {config.fcm_prob} is a probability of masking a key: give 0 <= fcm_prob < 1.")
    if source and "://" not in source and not (Path(source).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"initialize_from_hf: {source} is not a Hugging Face model directory (no config.json there). Point it "
            "at a directory written by save_pretrained, or remove the key."
        )


def with_hf_model_config(config: TrainLmConfig) -> TrainLmConfig:
    """The config with its model section read from initialize_from_hf's config.json, when use_hf_model_config and
    that is a URL."""
    # A local directory's config.json already gave the keys the config leaves out, as it was loaded, keeping those
    # it writes (lm_train.config.hf_model_section); taking all of them here would drop a written seq_len.
    if not config.use_hf_model_config or "://" not in str(config.initialize_from_hf):
        return config
    import hf_bridge

    try:
        model = hf_bridge.read_model_config(str(config.initialize_from_hf), model_type=config.model.model_type)
    except hf_bridge.HfBridgeError as e:
        raise ConfigError(f"use_hf_model_config: {e}") from None
    return dataclasses.replace(config, model=model)


def with_resolved_scan_unroll(config: TrainLmConfig) -> TrainLmConfig:
    """The config with `model.scan_unroll: auto` replaced by what it means on these devices, as config.yaml records."""
    model = config.model
    if getattr(model, "scan_unroll", None) != SCAN_UNROLL_AUTO:
        return config
    assert dataclasses.is_dataclass(model)  # every registered model config is one
    return dataclasses.replace(config, model=dataclasses.replace(model, scan_unroll=resolve_scan_unroll(model)))


def _check_plain_positions(config: TrainLmConfig) -> None:
    """Refuse packing and context parallelism for a model that needs whole sequences in order (DeepSeek-V3's MTP)."""
    why = config.model.needs_plain_positions()
    if why is None:
        return
    data = config.data
    if data.packed:
        chosen = "data.pack: true" if data.pack else f"data.format {data.format_type}, which packs by default"
        raise ConfigError(
            f"{why}, but {chosen} puts several documents in each sequence, with positions restarting at each one; "
            "set data.pack: false (one document per row), or turn that model key off."
        )
    size = context_size(config.trainer)
    if size > 1:
        raise ConfigError(
            f"{why}, but trainer.context_axis_size={size} (or trainer.mesh's context) splits each sequence over "
            f"{size} devices in a load-balanced order; set it to 1, or turn that model key off."
        )


def _check_eval_harness(config: TrainLmConfig) -> None:
    """trainer.eval_harness: lm-eval installed, and task names known, before any step is spent."""
    harness = config.trainer.eval_harness
    if not harness.enabled:
        return
    from lm_train.errors import require_lm_eval
    from lm_train.tools.harness.builtin_tasks import BUILTIN_TASKS

    require_lm_eval()
    unknown = sorted(set(harness.tasks) - set(BUILTIN_TASKS))
    if unknown and harness.include_path is None:
        raise ConfigError(
            f"trainer.eval_harness.tasks: unknown task(s) {unknown}. The built-in tasks are "
            f"{', '.join(BUILTIN_TASKS)}; for your own, set trainer.eval_harness.include_path to a directory of "
            "lm-eval YAML task configs."
        )
    if harness.include_path is not None and not Path(harness.include_path).is_dir():
        raise ConfigError(f"trainer.eval_harness.include_path: {harness.include_path} is not a directory.")


def prepare_run(config: TrainLmConfig, dist: DistributedInfo, config_files: Sequence[Path] = ()) -> RunSetup:
    """Check the config against the devices and the run directory, and decide everything that needs no data."""
    config = with_resolved_mp(config)
    trainer = config.trainer
    plan = plan_mesh(trainer)
    microbatches = check_batch_fits(trainer, plan, dist.process_count)
    _check_eval_batch(config, plan, dist.process_count)
    policy = parse_policy(trainer.mp)
    if not isinstance(config.optimizer, ScheduleConfig):
        raise ConfigError(
            f"optimizer.type {type(config.optimizer).__name__} has no learning-rate schedule: a registered optimizer "
            "config subclasses lm_train.config.optimizer_config.ScheduleConfig as well as OptimizerConfig."
        )
    optimizer, schedule = build_optimizer(config.optimizer, trainer.num_train_steps)
    _check_hf_source(config)
    config = with_resolved_scan_unroll(with_hf_model_config(config))
    _check_model_builds(config)
    check_pipeline(config, plan, microbatches)
    check_context(config)
    _check_plain_positions(config)
    check_data_format(config.data)
    check_lora(config)
    config = lora_base_as_absolute_path(config)
    _check_eval_harness(config)
    if config.data.is_mixture:
        mixture_schedule(config.data)  # weights, stages, sources, block size, stop strategy: before Ray
    paths = RunPaths.for_config(config, config_files)
    settings = StepSettings.of_config(config, microbatches, policy)
    resume_from = find_resume_checkpoint(config, paths)
    return RunSetup(config, dist, paths, plan, policy, settings, optimizer, schedule, resume_from)
