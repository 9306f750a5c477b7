"""Pipeline parallelism: a model's stacked layers split into stages over the `stage` mesh axis, microbatches
flowing through them on a GPipe schedule, and gradients by autodiff through that schedule.

The model keeps running its own embedding, head and loss on the whole batch: the run swaps only its layer stack
(lm_models' layer_stack() / with_layer_stack()) for a PipelinedStack with the same scan(). The embedding and the head
are position-local and cheap next to the stack, so running them on the whole batch, replicated over the stages,
costs a little compute and keeps every family's own code (norms, soft caps, tied heads, losses) in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train.config.trainer_config import TrainerConfig
from lm_train.run.mesh import STAGE

MICROBATCH = "microbatch"


@dataclass(frozen=True)
class PipelineSchedule:
    """How many stages, how many microbatches per step, and in which order the stages work."""

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    held_stages: int | None = None
    """Stages the traced program holds: None, all of them (the run's mesh); 1 for one device's share (the plan)."""

    @property
    def ticks(self) -> int:
        """Steps of the schedule's loop: every microbatch enters stage 0, and the last leaves the last stage."""
        return self.microbatches + self.stages - 1

    def bubble(self) -> float:
        """The fraction of the loop a stage idles: (stages - 1) / (microbatches + stages - 1) for GPipe."""
        return (self.stages - 1) / self.ticks

    def one_device_share(self) -> PipelineSchedule:
        """The schedule as one device runs it: its own stage, for every tick of the whole pipeline."""
        return dataclasses.replace(self, held_stages=1)

    def describe(self) -> str:
        """One line for the start log and the plan."""
        return (
            f"pipeline: {self.stages} stages x {self.microbatches} microbatches ({self.schedule}), bubble "
            f"{self.bubble():.1%} = ({self.stages} - 1) / ({self.microbatches} + {self.stages} - 1)"
        )


def pipeline_schedule(trainer: TrainerConfig) -> PipelineSchedule | None:
    """The run's schedule, or None without pipeline parallelism (trainer.pipeline_axis_size 1)."""
    stages = trainer.pipeline_axis_size
    if stages == 1:
        return None
    return PipelineSchedule(stages, trainer.pipeline.microbatches_for(stages), trainer.pipeline.schedule)


def pipelined(model: Any, schedule: PipelineSchedule, batch_axis: str) -> Any:
    """The model with its stacked layers run as a pipeline (same weights, same results)."""
    stack = model.layer_stack()
    if not isinstance(stack, nt.Stacked):
        raise TypeError(
            f"pipeline parallelism needs a model whose layer_stack() is an nt.Stacked; {type(model).__name__} "
            f"gives {type(stack).__name__}"
        )
    return model.with_layer_stack(PipelinedStack(stack, schedule, batch_axis))


def _strip_leading(tree: Any) -> Any:
    """NamedArray leaves without their first axis name (vmap removed that dimension of their arrays)."""
    return jax.tree.map(
        lambda x: nt.NamedArray(x.array, x.axes[1:]) if nt.is_named(x) else x, tree, is_leaf=nt.is_named
    )


def _stage_view(tree: Any, Layers: nt.Axis, Stage: nt.Axis) -> Any:
    """Every leaf's leading `layers` dimension viewed as (stage, layers per stage): stage s holds a contiguous chunk,
    which is the chunk the parameter mapping (layers -> stage) already put on its devices, so no data moves."""
    Local = Layers.resize(Layers.size // Stage.size)

    def one(x: Any) -> Any:
        if nt.is_named(x):
            x = x.permute(Layers, ...)
            array = x.array.reshape((Stage.size, Local.size, *x.array.shape[1:]))
            return nt.NamedArray(array, (Stage, Local, *x.axes[1:]))
        if eqx.is_array(x):
            return x.reshape((Stage.size, Local.size, *x.shape[1:]))
        return x

    return jax.tree.map(one, tree, is_leaf=nt.is_named)


def split_microbatches(x: nt.NamedArray, batch_axis: str, n: int) -> nt.NamedArray:
    """x as (microbatch, batch / n, ...): example j * n + i goes to microbatch i, so that each data-parallel
    device's contiguous block of the batch holds a share of every microbatch (as the step's accumulation does)."""
    x = x.permute(batch_axis, ...)
    Batch = x.axes[0]
    array = x.array.reshape((Batch.size // n, n, *x.array.shape[1:]))
    return nt.NamedArray(
        jnp.moveaxis(array, 1, 0), (nt.Axis(MICROBATCH, n), Batch.resize(Batch.size // n), *x.axes[1:])
    )


def join_microbatches(x: nt.NamedArray) -> nt.NamedArray:
    """The inverse of split_microbatches: (microbatch, batch / n, ...) back to (batch, ...)."""
    n, Micro = x.axes[0].size, x.axes[1]
    array = jnp.moveaxis(x.array, 0, 1).reshape((Micro.size * n, *x.array.shape[2:]))
    return nt.NamedArray(array, (Micro.resize(Micro.size * n), *x.axes[2:]))


def _has_axis(x: Any, name: str) -> bool:
    return nt.is_named(x) and x.has_axis(name)


class PipelinedStack(eqx.Module):
    """An nt.Stacked run as a GPipe pipeline over the `stage` mesh axis; its scan() is the stack's, minus caches."""

    stack: nt.Stacked
    schedule: PipelineSchedule = eqx.field(static=True)
    batch_axis: str = eqx.field(static=True)

    def __call__(self, x: Any, *args: Any, key: jax.Array | None = None, per_layer: Any = None, **kwargs: Any) -> Any:
        """Fold x through every layer, as the stack's own call does."""
        return self.scan(x, *args, key=key, per_layer=per_layer, **kwargs)[0]

    def scan(
        self, x: nt.NamedArray, *args: Any, key: jax.Array | None = None, per_layer: Any = None, **kwargs: Any
    ) -> tuple[nt.NamedArray, Any]:
        """(x after every layer, the layers' per-layer outputs); only stacks whose layers output no arrays."""
        S, M = self.schedule.stages, self.schedule.microbatches
        held = self.schedule.held_stages or S
        Layers, Stage = self.stack.Layers, nt.Axis(STAGE, held)
        Local = Layers.resize(Layers.size // held)
        per_layer = dict(per_layer or {})
        if "cache" in per_layer:
            raise ValueError("a pipelined layer stack is for training: decode with the model's own stack")
        per_layer = jax.tree.map(
            lambda v: v.permute(Layers, ...) if nt.is_named(v) else v, per_layer, is_leaf=nt.is_named
        )
        weights, static = eqx.partition(_stage_view(self.stack.stacked, Layers, Stage), eqx.is_array)
        static, per_layer = _strip_leading(static), _stage_view(per_layer, Layers, Stage)

        # Inputs that differ per example (a packed batch's mask and positions) follow their microbatch through the
        # stages; the rest (flags, offsets, plain positions) is the same for every microbatch.
        def per_example(v: Any) -> bool:
            return _has_axis(v, self.batch_axis)

        split_args, shared_args = eqx.partition((args, kwargs), per_example, is_leaf=nt.is_named)
        split_args = jax.tree.map(
            lambda v: split_microbatches(v, self.batch_axis, M) if nt.is_named(v) else v,
            split_args,
            is_leaf=nt.is_named,
        )
        inputs = nt.shard(split_microbatches(x, self.batch_axis, M))
        micro_axes = inputs.axes[1:]
        outputs_seen: list[Any] = []

        def stage_work(weights_s: Any, x_s: nt.NamedArray, args_s: Any, per_layer_s: Any, key_s: Any) -> jax.Array:
            # One stage's chunk of layers on its current microbatch (vmap gives each stage its own slice).
            weights_s, x_s, args_s, per_layer_s = _strip_leading((weights_s, x_s, args_s, per_layer_s))
            chunk = dataclasses.replace(self.stack, stacked=eqx.combine(weights_s, static), Layers=Local)
            stage_args, stage_kwargs = eqx.combine(args_s, shared_args, is_leaf=nt.is_named)
            y, outs = chunk.scan(x_s, *stage_args, key=key_s, per_layer=per_layer_s, **stage_kwargs)
            if jax.tree.leaves(outs):
                raise ValueError(
                    "pipeline parallelism needs layers that return no per-layer outputs; this stack's layers return "
                    "some (a mixture of experts' auxiliary losses): train it without trainer.pipeline_axis_size"
                )
            outputs_seen.append(outs)
            return y.array

        # spmd_axis_name: every sharding constraint inside the layers also splits the vmapped dimension over the
        # stage axis, so that each stage's devices compute their own stage only.
        run_stages = jax.vmap(stage_work, spmd_axis_name=STAGE)
        stage_ids = jnp.arange(held)
        at_stage = stage_ids.reshape((held,) + (1,) * len(micro_axes))

        def constrain(buffer: jax.Array) -> jax.Array:
            return nt.shard(nt.NamedArray(buffer, (Stage, *micro_axes))).array

        def tick(carry: tuple[jax.Array, jax.Array], t: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
            state, outputs = carry
            # Stage 0 takes the next microbatch; stage s > 0 works on what stage s - 1 finished last tick.
            buffer = constrain(jnp.where(at_stage == 0, inputs.array[jnp.minimum(t, M - 1)][None], state))
            micro = jnp.clip(t - stage_ids, 0, M - 1)  # the microbatch each stage holds (clipped in the bubble)
            args_now = jax.tree.map(
                lambda v: nt.NamedArray(v.array[micro], (Stage, *v.axes[1:])) if nt.is_named(v) else v,
                split_args,
                is_leaf=nt.is_named,
            )
            keys = None
            if key is not None:  # dropout differs per stage and per microbatch
                base_key = key
                keys = jax.vmap(lambda s, m: jax.random.fold_in(jax.random.fold_in(base_key, s), m))(stage_ids, micro)
            done = constrain(
                run_stages(weights, nt.NamedArray(buffer, (Stage, *micro_axes)), args_now, per_layer, keys)
            )
            # The last stage's result is microbatch t - (S - 1): a masked sum over the stages sends it from the last
            # stage to all (an all-reduce of one microbatch), for the head that every stage runs on the whole batch.
            # The other stages add exact zeros, so the result is bitwise the last stage's.
            finished = jnp.sum(jnp.where(at_stage == S - 1, done, jnp.zeros_like(done)), axis=0)
            slot = jnp.maximum(t - (S - 1), 0)
            kept = jnp.where(t >= S - 1, finished, jax.lax.dynamic_index_in_dim(outputs, slot, 0, keepdims=False))
            outputs = jax.lax.dynamic_update_index_in_dim(outputs, kept, slot, 0)
            # Activations move one stage on: a shift over the stage-sharded dimension, a collective permute.
            return (constrain(jnp.roll(done, 1, axis=0)), outputs), None

        state0 = jnp.zeros((held, *inputs.array.shape[1:]), inputs.dtype)
        (_, outputs), _ = jax.lax.scan(
            tick, (constrain(state0), jnp.zeros_like(inputs.array)), jnp.arange(self.schedule.ticks)
        )
        y = join_microbatches(nt.shard(nt.NamedArray(outputs, inputs.axes)))
        return nt.shard(y.permute(*x.axis_names)), outputs_seen[0]
