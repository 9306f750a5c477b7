"""One device's share of the train step, traced and never compiled: its shapes, its program, and that
program's peak of live buffers.

Each device holds its shard of the state (the parameter mapping) and runs the step on its rows of the batch,
with the tensor-parallel axes split (the compute mapping). So the trace takes every named array at its
per-device size: the state as sharded, the model as computed (FSDP-sharded axes gathered back, through a
marked all-gather whose transpose is the gradients' reduce-scatter), and the batch divided over the data
axes. Nothing here knows a model family: the shapes come from `eval_shape` of the state and the trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import kernels_for, unstack_layers, with_gradient_checkpointing
from lm_train.config.schema import TrainLmConfig
from lm_train.kinds import training_kind
from lm_train.optim import Optimizer
from lm_train.planning.program import Program, Values, build_program
from lm_train.planning.rules import EXCHANGE_MARK, GATHER_MARK
from lm_train.planning.shards import (
    Layout,
    compute_factors,
    is_shape,
    local_tree,
    quiet_divisibility,
    resize_static_axes,
    shard_factors,
    without_experts,
)
from lm_train.run.batch import named_batch
from lm_train.run.mesh import CONTEXT, EXPERT, POSITION
from lm_train.run.state import state_structure
from lm_train.run.step import StepSettings, make_train_step

if TYPE_CHECKING:
    from lm_train.run.training_kind import TrainingKind


def lm_train_plan_all_gather(x: jax.Array, dim: int, factor: int) -> jax.Array:
    """Stands for an all-gather of `factor` shards along `dim` (its transpose is the reduce-scatter)."""
    return jnp.concatenate([x] * factor, axis=dim)


_all_gather = jax.jit(lm_train_plan_all_gather, static_argnums=(1, 2))
assert lm_train_plan_all_gather.__name__ == GATHER_MARK


def lm_train_plan_exchange(x: jax.Array) -> jax.Array:
    """Stands for a collective that hands a device another device's array of the same shape (its transpose too)."""
    return -x


_exchange = jax.jit(lm_train_plan_exchange)
assert lm_train_plan_exchange.__name__ == EXCHANGE_MARK


def _between_devices(layout: Layout) -> AbstractContextManager:
    """Ring attention and expert dispatch as one device of the layout runs them (its blocks passed around the
    ring, its all-to-all buffers), where the layout splits positions or experts over devices."""
    if layout.shape.get(CONTEXT, 1) == 1 and layout.shape.get(EXPERT, 1) == 1:
        return nullcontext()
    return nt.nn.one_device(layout.compute_mapping, layout.shape, _exchange, _all_gather)


def _gatherer(model_structure: Any, layout: Layout) -> Callable[[Any], Any]:
    """A prepare_model hook: each FSDP-sharded axis of the model gathered back to its compute size."""
    leaves = jax.tree_util.tree_flatten_with_path(model_structure, is_leaf=nt.is_named)[0]
    plans: list[list[tuple[int, int, nt.Axis]]] = []
    routing = without_experts(layout.compute_mapping)
    with quiet_divisibility():
        for path, x in leaves:
            if not (nt.is_named(x) and is_shape(x.array)):
                plans.append([])
                continue
            held = shard_factors(x, layout.param_mapping, layout)
            # Expert parallelism moves tokens, not weights: a MoE layer's experts keep their `experts` shard
            # (each device runs its own on the tokens that reach it), while its router is gathered whole.
            computed = shard_factors(x, layout.compute_mapping if _in_experts(path) else routing, layout)
            plans.append(
                [
                    (dim, h // c, axis.resize(axis.size // c))
                    for dim, (axis, h, c) in enumerate(zip(x.axes, held, computed, strict=True))
                    if h > c and h % c == 0
                ]
            )

    def gather(model: Any) -> Any:
        flat, treedef = jax.tree.flatten(model, is_leaf=nt.is_named)
        out = []
        for x, steps in zip(flat, plans, strict=True):
            if steps and nt.is_named(x):
                array, axes = x.array, list(x.axes)
                for dim, factor, full in steps:
                    array = _all_gather(array, dim, factor)
                    axes[dim] = full
                x = nt.NamedArray(array, tuple(axes))
            out.append(x)
        return treedef.unflatten(out)

    return gather


def _in_experts(path: tuple[Any, ...]) -> bool:
    """Whether a leaf lies inside a MixtureOfExperts' `experts` (nt.nn.GatedExperts), by its tree path."""
    return any(getattr(key, "name", None) == "experts" for key in path)


@dataclass
class StepTrace:
    """One device's step: its program, what its buffers hold, and the sizes it was traced at."""

    program: Program
    values: Values
    argument_bytes: int
    donated_outputs: set[int]
    local_batch: int
    microbatches: int
    state_local: Any
    state_global: Any
    attention_kernels: frozenset[tuple] = frozenset()  # as lm_models chose them for the devices planned
    attention_notes: tuple[str, ...] = ()  # and its notes on that choice
    batch_fields: tuple[str, ...] = ("input_ids",)  # the batch's fields, each (local_batch, position)
    batch_bytes: int = 0  # the batch's bytes on one device


def trace_step(
    config: TrainLmConfig,
    layout: Layout,
    Vocab: nt.Axis,
    optimizer: Optimizer,
    schedule: Callable[[jax.Array], jax.Array],
    settings: StepSettings,
    *,
    structure: Any = None,
    upcast_bf16: bool = False,
    platform: str | None = None,
    training: TrainingKind | None = None,
) -> StepTrace:
    """Trace one device's train step for `config` on `layout` (shapes only: nothing runs or is allocated).

    structure: the state's global shapes (`state_structure`), if already known; its model's gradient
    checkpointing is set to the config's. upcast_bf16: count 16-bit floating temporaries at 4 bytes (XLA's CPU
    backend computes them in float32). platform: the devices planned for (`scan_unroll: auto` depends on them).
    training: the kind of training (default `lm-train run`'s): its objective, batch fields and extra state.
    """
    training = training or training_kind()
    if structure is None:
        structure = training.planned_state(state_structure(config, Vocab, optimizer), config)
    policy, kind = config.model.gradient_checkpointing, type(structure.model)

    def variant(model: Any) -> Any:
        model = with_gradient_checkpointing(model, policy, platform)
        # XLA lays out a scan unrolled over every layer as it does per-layer weights (its peak within 0-4% of
        # theirs, GPT-2 and Llama, 1 and 8 devices), not as the loop with stacked residuals that the jaxpr
        # still shows; so such a scan is traced as per-layer modules. The shards' bytes are the same.
        # A pipeline schedules the scanned stack itself: it stays a stack.
        unroll = settings.pipeline is None and _fully_unrolled(model)
        return eqx.filter_eval_shape(unstack_layers, model) if unroll else model

    # The model and its likes in the optimizer state (moments are model-shaped trees).
    structure = jax.tree.map(
        lambda x: variant(x) if isinstance(x, kind) else x, structure, is_leaf=lambda x: isinstance(x, kind)
    )
    # Positions are split over `context` in activations only: no weight has its per-device size cut by them.
    factors = {name: f for name, f in compute_factors(layout).items() if name != POSITION}
    local = resize_static_axes(local_tree(structure, layout.param_mapping, layout), factors)
    arrays, static = eqx.partition(local, is_shape)
    gather = _gatherer(structure.model, layout)
    step_fn = make_train_step(optimizer, settings, schedule, objective=training.objective(config), prepare_model=gather)
    batch_axis, Pos = config.trainer.batch_axis, config.model.Pos
    if layout.shape.get(CONTEXT, 1) > 1:
        # Context parallelism: a device holds its share of the positions, so its activations and its key/value
        # blocks are position-sharded; its ring attention is traced as it runs (_between_devices).
        Pos = Pos.resize(Pos.size // layout.shape[CONTEXT])
    local_batch = config.trainer.train_batch_size // layout.data_size

    def run(arrays: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
        new_state, metrics = step_fn(eqx.combine(arrays, static), named_batch(batch, batch_axis, Pos, specs))
        return eqx.partition(new_state, eqx.is_array)[0], metrics

    fields, specs = training.batch_fields(config), training.fields
    batch = {
        name: jax.ShapeDtypeStruct(
            (local_batch, Pos.size) if specs[name].per_token else (local_batch,), specs[name].dtype
        )
        for name in fields
    }
    # The kernels the planned devices would run: a GPU's cuDNN attention, which keeps no scores, is traced here
    # as ours blockwise, not as the materialised scores of this CPU's default.
    with kernels_for(platform or jax.default_backend()) as kernels, _between_devices(layout):
        closed = jax.make_jaxpr(run)(arrays, batch)
    program, values = build_program(closed, upcast_bf16=upcast_bf16)
    n_state = len(jax.tree.leaves(arrays))
    # Each device receives its rows of the batch at every position: the step reorders them for the ring's load
    # balance and keeps its own share, so the batch argument is whole over `context`.
    arrived = {
        name: math.prod((local_batch, config.model.Pos.size) if specs[name].per_token else (local_batch,))
        * jnp.dtype(specs[name].dtype).itemsize
        for name in fields
    }
    arg_bytes = sum(values.size[i] for i in program.inputs[:n_state]) + sum(arrived.values())
    donated = set(program.outputs[:n_state])
    return StepTrace(
        program,
        values,
        arg_bytes,
        donated,
        local_batch,
        settings.microbatches,
        local,
        structure,
        frozenset(kernels.chosen),
        tuple(kernels.notes),
        fields,
        sum(arrived.values()),
    )


def _fully_unrolled(model: Any) -> bool:
    """Whether the model's layer scan runs every layer in one unrolled step."""
    holder = getattr(model, "transformer", model)  # Backpack wraps another model's layer stack
    blocks = getattr(holder, "blocks", None)
    if not isinstance(blocks, nt.Stacked):
        return False
    unroll = blocks.unroll
    return unroll is True or (not isinstance(unroll, bool) and unroll >= blocks.Layers.size)


def with_remat(config: TrainLmConfig, policy: str) -> TrainLmConfig:
    """The config with another gradient checkpointing policy (any model family that has the key)."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, gradient_checkpointing=policy))
