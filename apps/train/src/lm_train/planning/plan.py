"""`lm-train plan`: a run's memory per device and its speed, from the config alone, for hardware named by a spec.

Everything comes from traces of one device's share of the train step (`trace`): the state's per-device
shards, the buffers live at each point of the step under XLA-like rules (`liveness`), and the matmul FLOPs the
step runs. Nothing is compiled or allocated.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train.config.schema import TrainLmConfig
from lm_train.kinds import training_kind
from lm_train.planning.devices import DeviceSpec
from lm_train.planning.estimate import (
    REMAT_ORDER,
    Planner,
    cpu_ignores_unrolled_remat,
    estimate_of,
    policy_name,
    remat_of_unrolled_layers,
    tree_bytes,
)
from lm_train.planning.figures import Plan
from lm_train.planning.loss_blocks import with_loss_blocks
from lm_train.planning.memory_limit import LIMIT_ENV, limit_override
from lm_train.planning.shards import Layout
from lm_train.planning.suggest import suggestions
from lm_train.planning.trace import with_remat
from lm_train.post.lora_training import has_adapters
from lm_train.run.context_parallel import context_size
from lm_train.run.mesh import check_batch_fits
from lm_train.run.pipeline import pipeline_schedule
from lm_train.run.precision import parse_policy, with_resolved_mp

if TYPE_CHECKING:
    from lm_train.run.training_kind import TrainingKind

DEFAULT_MFU = {"cpu": 0.6, "gpu": 0.45, "tpu": 0.45}


def usable_fraction(spec: DeviceSpec) -> tuple[float, str]:
    """The share of a device's memory a jax program may use, and why."""
    if spec.platform == "gpu":
        if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() == "false":
            return 0.95, "XLA_PYTHON_CLIENT_PREALLOCATE=false: all but a margin"
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        return fraction, f"jax preallocates {fraction:.0%} of a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION)"
    if spec.platform == "tpu":
        return 0.97, "a TPU reserves a little HBM for the runtime"
    return 0.9, "an equal share of the host's RAM, less a margin"


def usable_memory(spec: DeviceSpec) -> tuple[int, str]:
    """The bytes per device a run may use on `spec`, and why: LM_TRAIN_MEMORY_LIMIT when set."""
    override = limit_override()
    if override is not None:
        return override, LIMIT_ENV
    fraction, why = usable_fraction(spec)
    return int(spec.memory_bytes * fraction), why


def with_planned_loss_blocks(config: TrainLmConfig, spec: DeviceSpec, vocab_size: int) -> TrainLmConfig:
    """The config with the loss in vocabulary blocks where, on `spec`, one microbatch's logits would not fit."""
    layout = Layout.for_devices(config.trainer, spec.count)
    rows = config.trainer.train_batch_size // layout.data_size // check_batch_fits(config.trainer, layout, 1)
    return with_loss_blocks(config, vocab_size, rows, spec.platform, limit_override() or spec.memory_bytes)


def make_plan(
    config: TrainLmConfig,
    spec: DeviceSpec,
    *,
    vocab_size: int,
    vocab_from: str,
    mfu: float | None = None,
    peak_flops: float | None = None,
    peak_flops_from: str = "",
    suggest: bool = True,
    kind: TrainingKind | None = None,
    compiled_peak: int | None = None,
) -> Plan:
    """The plan of `config` on `spec` for a kind of training (default: `lm-train run`'s): per-device memory, the
    verdict, and the speed at `mfu`. With `compiled_peak` (XLA's figure for the same step), the verdict is that
    figure's."""
    kind = kind or training_kind()
    config = with_resolved_mp(config, spec.platform)  # `auto` means what it would on the planned devices
    asked_blocks = getattr(config.model, "cross_entropy_block_size", None)
    config = with_planned_loss_blocks(config, spec, vocab_size)
    blocks = getattr(config.model, "cross_entropy_block_size", None)
    planner = Planner(config, spec, vocab_size, kind)
    own_policy = policy_name(config.model.gradient_checkpointing)
    trace, layout = planner.trace(config)
    estimate = estimate_of(trace, config, layout, vocab_size)
    estimate.policy = own_policy
    policies = {own_policy: estimate}
    for policy in REMAT_ORDER:
        if policy not in policies:
            policies[policy] = planner.estimate(with_remat(config, policy))
            policies[policy].policy = policy

    state = trace.state_local
    param_bytes = tree_bytes(state.model)
    # What the optimizer updates, whose gradients exist: with LoRA, the adapters alone.
    trainable = (
        eqx.filter(state.model, nt.mask(state.model, nt.nn.lora_params)) if has_adapters(state.model) else state.model
    )
    trainable_bytes = tree_bytes(trainable, keep=lambda a: jnp.issubdtype(a.dtype, jnp.inexact))
    global_params = sum(
        x.array.size
        for x in jax.tree.leaves(trace.state_global.model, is_leaf=nt.is_named)
        if nt.is_named(x) and jnp.issubdtype(x.array.dtype, jnp.inexact)
    )
    tokens = config.trainer.train_batch_size * config.model.seq_len * kind.sequences_per_example
    model_flops = config.model.flops_per_token(vocab_size) * tokens * kind.flops_scale
    mfu = mfu if mfu is not None else DEFAULT_MFU[spec.platform]
    if peak_flops is None:
        if spec.chip is None:
            raise ValueError("a CPU spec needs the measured peak_flops")
        peak_flops, peak_flops_from = spec.chip.bf16_flops, f"{spec.chip.name} data sheet, dense bf16"
    step_seconds = model_flops / spec.count / (peak_flops * mfu)
    pipeline = pipeline_schedule(config.trainer)
    if pipeline is not None:  # each stage idles for the bubble's share of the step
        step_seconds /= 1 - pipeline.bubble()
    usable, why = usable_memory(spec)
    sampling = kind.sampling_memory(config, vocab_size, spec.platform) if kind.sampling_memory else None
    judged = estimate.peak_bytes if compiled_peak is None else compiled_peak
    if sampling is not None:  # XLA's figure, where compiled, is the train step's: the engine's come beside it
        judged = sampling.peak(judged, estimate.argument_bytes - trace.batch_bytes)
    plan = Plan(
        kind=kind.name,
        devices=spec.text,
        device_count=spec.count,
        chip=spec.chip.name if spec.chip else "cpu",
        platform=spec.platform,
        mesh=dict(layout.shape),
        memory_bytes_per_device=spec.memory_bytes,
        usable_bytes_per_device=usable,
        usable_why=why,
        vocab_size=vocab_size,
        vocab_from=vocab_from,
        seq_len=config.model.seq_len,
        mp=config.trainer.mp,
        tokens_per_step=tokens,
        parameter_count=global_params,
        parameters_bytes=param_bytes,
        gradients_bytes=trainable_bytes,
        optimizer_state_bytes=tree_bytes(state.opt_state),
        frozen_bytes=tree_bytes(state.frozen) if state.frozen is not None else 0,
        batch_bytes=trace.batch_bytes,
        batch_fields=list(trace.batch_fields),
        estimate=estimate,
        policies=policies,
        model_flops_per_step=model_flops,
        peak_flops_per_device=peak_flops,
        peak_flops_from=peak_flops_from,
        mfu=mfu,
        step_seconds=step_seconds,
        tokens_per_second=tokens / step_seconds,
        fits=judged <= usable,
        margin_bytes=usable - judged,
        compiled_peak_bytes=compiled_peak,
        cross_entropy_block_size=getattr(config.model, "cross_entropy_block_size", None),
        kind_note=kind.plan_note,
        frozen_label=kind.frozen_label,
        sampling=sampling,
    )
    plan.notes = _notes(config, spec) + list(trace.attention_notes)
    left_out = kind.frozen_left_out(config) if kind.frozen_model is not None else None
    if left_out is not None:  # e.g. RL with LoRA, whose reference is the policy's own base weights
        plan.notes.append(left_out)
    if pipeline is not None:
        plan.notes.append(
            f"{pipeline.describe()}; the memory counts each device's own stage's layers and the activations of "
            f"every microbatch in flight, and the step time the bubble"
        )
    if blocks != asked_blocks:
        plan.notes.append(
            f"one microbatch's full logits would not fit in a device's memory: the loss scores the vocabulary in "
            f"blocks of {blocks} (model.cross_entropy_block_size, as the run sets it)"
        )
    if suggest and not plan.fits:
        # Against XLA's figure, each variant's estimate is taken as low or high as this config's.
        target = usable if compiled_peak is None else int(usable * estimate.peak_bytes / max(compiled_peak, 1))
        if sampling is not None:  # the variants change the train step; the engine keeps its cache beside it
            target -= sampling.kv_cache_bytes + sampling.kept_bytes
        plan.suggestions = suggestions(planner, plan, target=target)
    return plan


def _notes(config: TrainLmConfig, spec: DeviceSpec) -> list[str]:
    """What the reader should know about how far to trust this plan's figures."""
    notes = []
    if spec.chip is not None and parse_policy(config.trainer.mp).compute_dtype == jnp.float32:
        notes.append("compute is f32 (trainer.mp): the step time assumes the chip's bf16 peak and is optimistic")
    if remat_of_unrolled_layers(config.model, spec.platform):
        if spec.platform != "cpu":
            notes.append(
                "remat of unrolled layers (model.scan_layers false, or scan_unroll over every layer): jax 0.10's "
                "XLA:CPU ignores it, keeping every layer's activations (up to ~2x this peak); not yet measured here"
            )
        elif cpu_ignores_unrolled_remat():
            notes.append(
                "remat of unrolled layers (model.scan_layers false, or scan_unroll over every layer): this jax's "
                "XLA:CPU keeps every layer's activations whatever the policy, so the plan counts them all"
            )
    context = context_size(config.trainer)
    if context > 1:
        local = config.model.seq_len // context
        heads = getattr(config.model, "num_heads", 0) // max(config.trainer.model_axis_size, 1)
        block = local * local * heads * 4
        notes.append(
            f"context parallelism over {context} devices: activations and key/value blocks are counted at "
            f"{local} positions per device; ring attention is traced as each device runs it, its key/value blocks "
            f"passed round and one block of f32 scores at a time ({local}² positions x {heads} heads per example = "
            f"{block / 2**30:.3g} GiB)"
        )
    return notes
