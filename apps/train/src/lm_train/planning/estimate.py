"""One traced variant of a run, measured: its peak per device, the parts of it, and the matmul FLOPs it runs."""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import resolve_scan_unroll
from lm_train.config.schema import TrainLmConfig
from lm_train.kinds import training_kind
from lm_train.optim import build_optimizer
from lm_train.planning import liveness
from lm_train.planning.devices import DeviceSpec
from lm_train.planning.figures import Estimate
from lm_train.planning.program import attention_score_shapes, matmul_flops
from lm_train.planning.shards import Layout
from lm_train.planning.trace import StepTrace, trace_step
from lm_train.run.mesh import check_batch_fits
from lm_train.run.pipeline_checks import check_pipeline_batch
from lm_train.run.state import state_structure
from lm_train.run.step import StepSettings

if TYPE_CHECKING:
    from lm_train.run.training_kind import TrainingKind

# Cheapest first: each keeps less of the forward pass and recomputes more of it in the backward.
REMAT_ORDER = ("none", "save_block_outputs", "full", "nested")


@cache
def cpu_computes_bf16_in_f32() -> bool:
    """Whether this jax's CPU backend runs a bfloat16 matmul in float32 (jax 0.10's does; 0.11's runs it in bf16)."""
    cpu = jax.devices("cpu")[0]
    x = jax.ShapeDtypeStruct((8, 8), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(cpu))
    return "f32[8,8]" in jax.jit(jnp.matmul).lower(x, x).compile().as_text()


@cache
def cpu_ignores_unrolled_remat() -> bool:
    """Whether this jax's CPU backend keeps the activations of checkpointed unrolled layers as if unchecked.

    Two compiles of a 4-layer gradient, with and without jax.checkpoint: jax 0.10's XLA:CPU gives both the same
    temporaries; jax 0.11's gives the checkpointed one less.
    """

    def layer(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.tanh(jnp.tanh(x @ w) @ w.T) + x

    def temporaries(remat: bool) -> int:
        step = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable) if remat else layer

        def loss(ws: jax.Array, x: jax.Array) -> jax.Array:
            for i in range(ws.shape[0]):
                x = step(x, ws[i])
            return jnp.sum(x)

        on_cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        ws = jax.ShapeDtypeStruct((4, 64, 64), jnp.float32, sharding=on_cpu)
        x = jax.ShapeDtypeStruct((256, 64), jnp.float32, sharding=on_cpu)
        return jax.jit(jax.grad(loss)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

    return temporaries(True) >= temporaries(False)


def tree_bytes(tree: Any, keep: Any = None) -> int:
    leaves = jax.tree.leaves(tree, is_leaf=nt.is_named)
    total = 0
    for x in leaves:
        array = x.array if nt.is_named(x) else x
        if isinstance(array, jax.ShapeDtypeStruct) and (keep is None or keep(array)):
            total += array.size * jnp.dtype(array.dtype).itemsize
    return total


KERNEL_NAMES = {
    ("vanilla",): "ours",
    ("blockwise",): "ours blockwise",
    ("fused", "cudnn"): "cuDNN's fused kernel",
    ("fused", "xla"): "jax's XLA kernel",
    ("fused", "splash"): "the Pallas splash kernel",
}
# Fused kernels that keep their blocks of scores on chip; ours blockwise stands in for them in a trace made
# off their devices (lm_models.kernels_for).
ON_CHIP_SCORES = {("fused", "cudnn"), ("fused", "splash")}


def _is_big_logits(shape: tuple[int, ...], vocab: int, tokens: int) -> bool:
    return vocab in shape and math.prod(shape) >= tokens * vocab


def _scores_like(shape: tuple[int, ...], score_shapes: set[tuple[int, ...]]) -> bool:
    """A buffer of attention scores: one layer's, or a stack of them (the leading axis of a scanned stack)."""
    return any(shape[len(shape) - len(s) :] == s for s in score_shapes if len(shape) >= len(s))


def estimate_of(trace: StepTrace, config: TrainLmConfig, layout: Layout, vocab: int) -> Estimate:
    peak = liveness.peak_bytes(trace.program, trace.values, free_outputs=trace.donated_outputs)
    boundary = liveness.live_before_backward(trace.program, trace.values, trace.donated_outputs)
    values = trace.values
    seq = config.model.seq_len
    score_shapes = attention_score_shapes(trace.program, values, seq)
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
    if trace.attention_kernels and trace.attention_kernels <= ON_CHIP_SCORES:
        # The stand-in, ours blockwise, holds one block in memory: the whole (position, key_position) matrix when
        # the sequence fits in one block.
        scores = scores_saved = 0
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
        attention_kernels=sorted(KERNEL_NAMES.get(k, " ".join(k)) for k in trace.attention_kernels),
        executed_flops=matmul_flops(trace.program),
        microbatches=trace.microbatches,
        local_batch=trace.local_batch,
    )


class Planner:
    """Traces variants of one run on one device spec."""

    def __init__(self, config: TrainLmConfig, spec: DeviceSpec, vocab: int, kind: TrainingKind | None = None):
        kind = kind or training_kind()  # `lm-train run`'s unless told
        self.config, self.spec, self.Vocab, self.kind = config, spec, nt.Axis("vocab", vocab), kind
        self.optimizer, self.schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
        self.upcast = spec.platform == "cpu" and cpu_computes_bf16_in_f32()
        # The same for every variant.
        self.structure = kind.planned_state(state_structure(config, self.Vocab, self.optimizer), config)

    def layout(self, config: TrainLmConfig) -> Layout:
        return Layout.for_devices(config.trainer, self.spec.count)

    def trace(self, config: TrainLmConfig) -> tuple[StepTrace, Layout]:
        layout = self.layout(config)
        cpu = self.spec.platform == "cpu"
        if cpu and remat_of_unrolled_layers(config.model, "cpu") and cpu_ignores_unrolled_remat():
            # jax 0.10's XLA:CPU keeps every unrolled layer's activations whatever the policy: its measured peak is
            # the one without remat (GPT-2 and Llama, 1 and 8 devices; the plan counted 0.40-0.51 of it before).
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, gradient_checkpointing=False))
        microbatches = check_batch_fits(config.trainer, layout, 1)
        settings = StepSettings.of_config(config, microbatches)
        check_pipeline_batch(config.trainer, layout.data_size, microbatches)
        if settings.pipeline is not None:  # one device holds its own stage's layers and runs every tick
            settings = dataclasses.replace(settings, pipeline=settings.pipeline.one_device_share())
        trace = trace_step(
            config,
            layout,
            self.Vocab,
            self.optimizer,
            self.schedule,
            settings,
            structure=self.structure,
            upcast_bf16=self.upcast,
            platform=self.spec.platform,
            training=self.kind,
        )
        return trace, layout

    def estimate(self, config: TrainLmConfig) -> Estimate:
        trace, layout = self.trace(config)
        return estimate_of(trace, config, layout, self.Vocab.size)


def remat_of_unrolled_layers(model: Any, platform: str) -> bool:
    """Whether the model checkpoints layers that are unrolled on `platform` (per-layer modules, or a scan unrolled
    in full)."""
    if model.gradient_checkpointing in (False, "none"):
        return False
    unroll = resolve_scan_unroll(model, platform) if hasattr(model, "scan_unroll") else 1
    fully_unrolled = unroll is True or (not isinstance(unroll, bool) and unroll >= model.num_layers)
    return not getattr(model, "scan_layers", True) or fully_unrolled


def policy_name(value: bool | str) -> str:
    return "full" if value is True else "none" if value is False else str(value)
