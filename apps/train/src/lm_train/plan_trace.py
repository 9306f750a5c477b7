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
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

import named_tensors as nt
from lm_models import LmConfig, with_gradient_checkpointing
from lm_train import liveness
from lm_train.batch import FIELD_DTYPES, named_batch
from lm_train.config.schema import TrainLmConfig
from lm_train.config.trainer_config import TrainerConfig
from lm_train.mesh import DATA, MODEL, REPLICA, axis_mappings, mesh_shape
from lm_train.optim import Optimizer
from lm_train.state import state_structure
from lm_train.step import StepSettings, make_train_step


@dataclass(frozen=True)
class Layout:
    """A mesh known by its shape alone (no devices needed) and the run's axis mappings on it."""

    shape: dict[str, int]
    param_mapping: dict[str, Any]
    compute_mapping: dict[str, Any]

    @staticmethod
    def for_devices(trainer: TrainerConfig, device_count: int) -> Layout:
        shape = mesh_shape(trainer, device_count)
        return Layout(shape, *axis_mappings(trainer, shape))

    @property
    def mesh(self) -> AbstractMesh:
        return AbstractMesh(tuple(self.shape.values()), tuple(self.shape))

    @property
    def data_size(self) -> int:
        return self.shape[REPLICA] * self.shape[DATA]

    @property
    def model_size(self) -> int:
        return self.shape[MODEL]

    @property
    def device_count(self) -> int:
        return math.prod(self.shape.values())


def _is_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _parts(spec_entry: Any, mesh_shape_: dict[str, int]) -> int:
    if spec_entry is None:
        return 1
    names = (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)
    return math.prod(mesh_shape_[n] for n in names)


def shard_factors(x: nt.NamedArray, mapping: dict[str, Any], layout: Layout) -> tuple[int, ...]:
    """How many ways each axis of a named array is split over the mesh under `mapping`."""
    spec = nt.partition_spec(x.axes, mapping, layout.mesh)
    return tuple(_parts(entry, layout.shape) for entry in spec)


def _local(x: nt.NamedArray, factors: tuple[int, ...]) -> nt.NamedArray:
    axes = tuple(a.resize(a.size // f) for a, f in zip(x.axes, factors, strict=True))
    return nt.NamedArray(jax.ShapeDtypeStruct(tuple(a.size for a in axes), x.array.dtype), axes)


def local_tree(tree: Any, mapping: dict[str, Any], layout: Layout) -> Any:
    """The tree with every named array at the size one device holds under `mapping` (plain arrays whole)."""

    def one(x: Any) -> Any:
        if nt.is_named(x) and _is_shape(x.array):
            with _quiet_divisibility():
                return _local(x, shard_factors(x, mapping, layout))
        return x

    return jax.tree.map(one, tree, is_leaf=nt.is_named)


def _compute_factors(layout: Layout) -> dict[str, int]:
    """Axis name -> the ways the compute mapping splits it (the tensor-parallel axes; the batch too)."""
    factors = {}
    for name, target in layout.compute_mapping.items():
        parts = _parts(target, layout.shape)
        if parts > 1:
            factors[name] = parts
    return factors


def _resize_static_axes(obj: Any, factors: dict[str, int]) -> Any:
    """obj with every Axis held in a module's static fields (a Linear's In and Out, an attention layer's heads)
    at its per-device compute size, so that the layers agree with their per-device weights. Named arrays and
    model configs are left as they are."""
    if isinstance(obj, nt.Axis):
        f = factors.get(obj.name, 1)
        return obj.resize(obj.size // f) if f > 1 and obj.size % f == 0 else obj
    if nt.is_named(obj) or isinstance(obj, jax.ShapeDtypeStruct):
        return obj
    if isinstance(obj, tuple | list):
        items = [_resize_static_axes(x, factors) for x in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    if isinstance(obj, dict):
        return {k: _resize_static_axes(v, factors) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, LmConfig):
        changed = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name, None)
            new = _resize_static_axes(value, factors)
            if new is not value:
                changed[f.name] = new
        if not changed:
            return obj
        copy = object.__new__(type(obj))  # no __init__: modules' initialisers take other arguments
        for f in dataclasses.fields(obj):
            object.__setattr__(copy, f.name, changed.get(f.name, getattr(obj, f.name)))
        return copy
    return obj


@contextmanager
def _quiet_divisibility() -> Iterator[None]:
    """partition_spec warns when an axis does not divide; the plan reports sizes, it need not warn per trace."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def lm_train_plan_all_gather(x: jax.Array, dim: int, factor: int) -> jax.Array:
    """Stands for an all-gather of `factor` shards along `dim` (its transpose is the reduce-scatter)."""
    return jnp.concatenate([x] * factor, axis=dim)


_all_gather = jax.jit(lm_train_plan_all_gather, static_argnums=(1, 2))
assert lm_train_plan_all_gather.__name__ == liveness.GATHER_MARK


def _gatherer(model_structure: Any, layout: Layout) -> Callable[[Any], Any]:
    """A prepare_model hook: each FSDP-sharded axis of the model gathered back to its compute size."""
    leaves = jax.tree.leaves(model_structure, is_leaf=nt.is_named)
    plans: list[list[tuple[int, int, nt.Axis]]] = []
    with _quiet_divisibility():
        for x in leaves:
            if not (nt.is_named(x) and _is_shape(x.array)):
                plans.append([])
                continue
            held = shard_factors(x, layout.param_mapping, layout)
            computed = shard_factors(x, layout.compute_mapping, layout)
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


@dataclass
class StepTrace:
    """One device's step: its program, what its buffers hold, and the sizes it was traced at."""

    program: liveness.Program
    values: liveness.Values
    argument_bytes: int
    donated_outputs: set[int]
    local_batch: int
    microbatches: int
    state_local: Any
    state_global: Any


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
) -> StepTrace:
    """Trace one device's train step for `config` on `layout` (shapes only: nothing runs or is allocated).

    structure: the state's global shapes (`state_structure`), if already known; its model's gradient
    checkpointing is set to the config's. upcast_bf16: count 16-bit floating temporaries at 4 bytes (XLA's CPU
    backend computes them in float32).
    """
    if structure is None:
        structure = state_structure(config, Vocab, optimizer)
    else:  # the model and its likes in the optimizer state (moments are model-shaped trees)
        policy, kind = config.model.gradient_checkpointing, type(structure.model)
        structure = jax.tree.map(
            lambda x: with_gradient_checkpointing(x, policy) if isinstance(x, kind) else x,
            structure,
            is_leaf=lambda x: isinstance(x, kind),
        )
    local = _resize_static_axes(local_tree(structure, layout.param_mapping, layout), _compute_factors(layout))
    arrays, static = eqx.partition(local, _is_shape)
    step_fn = make_train_step(optimizer, settings, schedule, prepare_model=_gatherer(structure.model, layout))
    batch_axis, Pos = config.trainer.batch_axis, config.model.Pos
    local_batch = config.trainer.train_batch_size // layout.data_size

    def run(arrays: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
        new_state, metrics = step_fn(eqx.combine(arrays, static), named_batch(batch, batch_axis, Pos))
        return eqx.partition(new_state, eqx.is_array)[0], metrics

    batch = {"input_ids": jax.ShapeDtypeStruct((local_batch, Pos.size), FIELD_DTYPES["input_ids"])}
    closed = jax.make_jaxpr(run)(arrays, batch)
    program, values = liveness.build_program(closed, upcast_bf16=upcast_bf16)
    n_state = len(jax.tree.leaves(arrays))
    arg_bytes = sum(values.size[i] for i in program.inputs)
    return StepTrace(
        program, values, arg_bytes, set(program.outputs[:n_state]), local_batch, settings.microbatches, local, structure
    )


def with_remat(config: TrainLmConfig, policy: str) -> TrainLmConfig:
    """The config with another gradient checkpointing policy (any model family that has the key)."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, gradient_checkpointing=policy))
