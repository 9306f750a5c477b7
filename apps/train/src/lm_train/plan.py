"""`lm-train plan`: a run's memory per device and its speed, from the config alone, for hardware named by a spec.

Everything comes from traces of one device's share of the train step (`plan_trace`): the state's per-device
shards, the buffers live at each point of the step under XLA-like rules (`liveness`), and the matmul FLOPs the
step runs. Nothing is compiled or allocated.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train import liveness
from lm_train.config.schema import TrainLmConfig
from lm_train.device_spec import DeviceSpec
from lm_train.errors import ConfigError
from lm_train.mesh import check_batch_fits
from lm_train.optim import build_optimizer
from lm_train.plan_trace import Layout, StepTrace, trace_step, with_remat
from lm_train.precision import parse_policy
from lm_train.state import state_structure
from lm_train.step import StepSettings

# Cheapest first: each keeps less of the forward pass and recomputes more of it in the backward.
REMAT_ORDER = ("none", "save_block_outputs", "full", "nested")
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


@dataclass
class Estimate:
    """One traced variant of the run: its peak per device and the parts of it."""

    policy: str
    per_device_parallelism: int
    model_axis_size: int
    peak_bytes: int
    argument_bytes: int
    temporary_bytes: int
    peak_at: str
    saved_activation_bytes: int
    logits_bytes: int
    attention_scores_bytes: int
    attention_scores_saved: int
    executed_flops: float
    microbatches: int
    local_batch: int


@dataclass
class Plan:
    """What `lm-train plan` reports (all memory in bytes per device)."""

    devices: str
    device_count: int
    chip: str
    platform: str
    mesh: dict[str, int]
    memory_bytes_per_device: int
    usable_bytes_per_device: int
    usable_why: str
    vocab_size: int
    vocab_from: str
    seq_len: int
    mp: str
    tokens_per_step: int
    parameter_count: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    batch_bytes: int
    estimate: Estimate
    policies: dict[str, Estimate]
    model_flops_per_step: float
    peak_flops_per_device: float
    peak_flops_from: str
    mfu: float
    step_seconds: float
    tokens_per_second: float
    fits: bool
    margin_bytes: int
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes_per_device(self) -> int:
        return self.estimate.peak_bytes

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["peak_bytes_per_device"] = self.peak_bytes_per_device
        return out


def _tree_bytes(tree: Any, keep: Any = None) -> int:
    leaves = jax.tree.leaves(tree, is_leaf=nt.is_named)
    total = 0
    for x in leaves:
        array = x.array if nt.is_named(x) else x
        if isinstance(array, jax.ShapeDtypeStruct) and (keep is None or keep(array)):
            total += array.size * jnp.dtype(array.dtype).itemsize
    return total


def _is_big_logits(shape: tuple[int, ...], vocab: int, tokens: int) -> bool:
    return vocab in shape and math.prod(shape) >= tokens * vocab


def _scores_like(shape: tuple[int, ...], score_shapes: set[tuple[int, ...]]) -> bool:
    """A buffer of attention scores: one layer's, or a stack of them (the leading axis of a scanned stack)."""
    return any(shape[len(shape) - len(s) :] == s for s in score_shapes if len(shape) >= len(s))


def _estimate(trace: StepTrace, config: TrainLmConfig, layout: Layout, vocab: int) -> Estimate:
    peak = liveness.peak_bytes(trace.program, trace.values, free_outputs=trace.donated_outputs)
    boundary = liveness.live_before_backward(trace.program, trace.values, trace.donated_outputs)
    values = trace.values
    seq = config.model.seq_len
    score_shapes = liveness.attention_score_shapes(trace.program, values, seq)
    micro_tokens = trace.local_batch // trace.microbatches * seq
    saved = logits = 0
    scores_saved = 0
    for vid in boundary.live if boundary else []:
        shape = values.shape[vid]
        if _is_big_logits(shape, vocab, micro_tokens):
            logits += values.size[vid]
        else:
            saved += values.size[vid]
            if _scores_like(shape, score_shapes):
                one = next(s for s in score_shapes if shape[len(shape) - len(s) :] == s)
                scores_saved += math.prod(shape[: len(shape) - len(one)])
    scores = max((values.size[v] for v in values.size if values.shape[v] in score_shapes), default=0)
    return Estimate(
        policy=str(config.model.gradient_checkpointing),
        per_device_parallelism=config.trainer.per_device_parallelism,
        model_axis_size=layout.model_size,
        peak_bytes=trace.argument_bytes + peak.bytes,
        argument_bytes=trace.argument_bytes,
        temporary_bytes=peak.bytes,
        peak_at=peak.where,
        saved_activation_bytes=saved,
        logits_bytes=logits,
        attention_scores_bytes=scores,
        attention_scores_saved=scores_saved,
        executed_flops=liveness.matmul_flops(trace.program),
        microbatches=trace.microbatches,
        local_batch=trace.local_batch,
    )


class _Planner:
    """Traces variants of one run on one device spec."""

    def __init__(self, config: TrainLmConfig, spec: DeviceSpec, vocab: int):
        self.config, self.spec, self.Vocab = config, spec, nt.Axis("vocab", vocab)
        self.optimizer, self.schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
        self.upcast = spec.platform == "cpu"
        self.structure = state_structure(config, self.Vocab, self.optimizer)  # the same for every variant

    def layout(self, config: TrainLmConfig) -> Layout:
        return Layout.for_devices(config.trainer, self.spec.count)

    def trace(self, config: TrainLmConfig) -> tuple[StepTrace, Layout]:
        layout = self.layout(config)
        microbatches = check_batch_fits(config.trainer, layout, 1)
        settings = StepSettings(
            parse_policy(config.trainer.mp), microbatches, config.z_loss_weight, config.trainer.batch_axis
        )
        trace = trace_step(
            config,
            layout,
            self.Vocab,
            self.optimizer,
            self.schedule,
            settings,
            structure=self.structure,
            upcast_bf16=self.upcast,
        )
        return trace, layout

    def estimate(self, config: TrainLmConfig) -> Estimate:
        trace, layout = self.trace(config)
        return _estimate(trace, config, layout, self.Vocab.size)


def _policy_name(value: bool | str) -> str:
    return "full" if value is True else "none" if value is False else str(value)


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
) -> Plan:
    """The plan of `config` on `spec`: per-device memory, the verdict, and the speed at `mfu`."""
    planner = _Planner(config, spec, vocab_size)
    own_policy = _policy_name(config.model.gradient_checkpointing)
    trace, layout = planner.trace(config)
    estimate = _estimate(trace, config, layout, vocab_size)
    estimate.policy = own_policy
    policies = {own_policy: estimate}
    for policy in REMAT_ORDER:
        if policy not in policies:
            policies[policy] = planner.estimate(with_remat(config, policy))
            policies[policy].policy = policy

    state = trace.state_local
    param_bytes = _tree_bytes(state.model)
    trainable_bytes = _tree_bytes(state.model, keep=lambda a: jnp.issubdtype(a.dtype, jnp.inexact))
    global_params = sum(
        x.array.size
        for x in jax.tree.leaves(trace.state_global.model, is_leaf=nt.is_named)
        if nt.is_named(x) and jnp.issubdtype(x.array.dtype, jnp.inexact)
    )
    tokens = config.trainer.train_batch_size * config.model.seq_len
    model_flops = config.model.flops_per_token(vocab_size) * tokens
    mfu = mfu if mfu is not None else DEFAULT_MFU[spec.platform]
    if peak_flops is None:
        if spec.chip is None:
            raise ValueError("a CPU spec needs the measured peak_flops")
        peak_flops, peak_flops_from = spec.chip.bf16_flops, f"{spec.chip.name} data sheet, dense bf16"
    step_seconds = model_flops / spec.count / (peak_flops * mfu)
    fraction, why = usable_fraction(spec)
    usable = int(spec.memory_bytes * fraction)
    plan = Plan(
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
        optimizer_state_bytes=_tree_bytes(state.opt_state),
        batch_bytes=trace.local_batch * config.model.seq_len * 4,
        estimate=estimate,
        policies=policies,
        model_flops_per_step=model_flops,
        peak_flops_per_device=peak_flops,
        peak_flops_from=peak_flops_from,
        mfu=mfu,
        step_seconds=step_seconds,
        tokens_per_second=tokens / step_seconds,
        fits=estimate.peak_bytes <= usable,
        margin_bytes=usable - estimate.peak_bytes,
    )
    if suggest and not plan.fits:
        plan.suggestions = suggestions(planner, plan)
    return plan


def _fits_note(planner: _Planner, plan: Plan, estimate: Estimate) -> str:
    spare = plan.usable_bytes_per_device - estimate.peak_bytes
    slower = estimate.executed_flops / max(plan.estimate.executed_flops, 1.0) - 1.0
    cost = f", about {slower:+.0%} step time (more recomputation)" if abs(slower) >= 0.005 else ""
    return f"peak {estimate.peak_bytes / 2**30:.2f} GiB, {spare / 2**30:.2f} GiB to spare{cost}"


def suggestions(planner: _Planner, plan: Plan, max_tries: int = 6) -> list[str]:
    """The smallest change of each kind that makes the run fit: a remat policy, microbatches, a larger model axis."""
    config, usable, found = planner.config, plan.usable_bytes_per_device, []
    own = _policy_name(config.model.gradient_checkpointing)
    start = REMAT_ORDER.index(own) if own in REMAT_ORDER else 0
    for policy in REMAT_ORDER[start + 1 :]:
        estimate = plan.policies[policy]
        if estimate.peak_bytes <= usable:
            found.append(f"--model.gradient_checkpointing {policy}: {_fits_note(planner, plan, estimate)}")
            break
    trainer = config.trainer
    per_device = plan.estimate.local_batch // plan.estimate.microbatches
    tries = 0
    while per_device > 1 and tries < max_tries:
        per_device //= 2
        tries += 1
        candidate = dataclasses.replace(config, trainer=dataclasses.replace(trainer, per_device_parallelism=per_device))
        try:
            estimate = planner.estimate(candidate)
        except ConfigError:
            continue
        if estimate.peak_bytes <= usable:
            found.append(
                f"--trainer.per_device_parallelism {per_device} ({estimate.microbatches} microbatches of gradient "
                f"accumulation): {_fits_note(planner, plan, estimate)}"
            )
            break
    model_axis = plan.estimate.model_axis_size
    tries = 0
    while model_axis * 2 <= planner.spec.count and tries < max_tries:
        model_axis *= 2
        tries += 1
        candidate = dataclasses.replace(
            config, trainer=dataclasses.replace(trainer, model_axis_size=model_axis, mesh=None)
        )
        try:
            estimate = planner.estimate(candidate)
        except ConfigError:
            continue
        if estimate.peak_bytes <= usable:
            found.append(
                f"--trainer.model_axis_size {model_axis} (tensor parallelism over {model_axis} devices): "
                f"{_fits_note(planner, plan, estimate)}"
            )
            break
    if plan.estimate.attention_scores_bytes and not getattr(config.model, "use_flash_attention", True):
        candidate = dataclasses.replace(config, model=dataclasses.replace(config.model, use_flash_attention=True))
        estimate = planner.estimate(candidate)
        if estimate.peak_bytes <= usable:
            found.append(f"--model.use_flash_attention true: {_fits_note(planner, plan, estimate)}")
    return found
