"""One device's share of a run's shapes: a mesh known by its shape alone, and named arrays at their shard sizes.

Each device holds its shard of the state (the parameter mapping) and computes with the tensor-parallel axes
split (the compute mapping); nothing here needs the devices themselves.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh

import named_tensors as nt
from lm_models import LmConfig
from lm_train.config.trainer_config import TrainerConfig
from lm_train.run.mesh import MODEL, axis_mappings, batch_devices, mesh_shape


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
        return batch_devices(self.shape)

    @property
    def model_size(self) -> int:
        return self.shape[MODEL]

    @property
    def device_count(self) -> int:
        return math.prod(self.shape.values())


def is_shape(x: Any) -> bool:
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
    if x.array is None:
        return nt.NamedArray(None, axes)
    return nt.NamedArray(jax.ShapeDtypeStruct(tuple(a.size for a in axes), x.array.dtype), axes)


def local_tree(tree: Any, mapping: dict[str, Any], layout: Layout) -> Any:
    """The tree with every named array at the size one device holds under `mapping` (plain arrays whole)."""

    def one(x: Any) -> Any:
        if nt.is_named(x) and (is_shape(x.array) or x.array is None):
            # None: a leaf that a partitioned tree leaves out (LoRA's optimizer state has moments for the
            # adapters alone); its axes must still agree with the model's.
            with quiet_divisibility():
                return _local(x, shard_factors(x, mapping, layout))
        return x

    return jax.tree.map(one, tree, is_leaf=nt.is_named)


def without_experts(mapping: dict[str, Any]) -> dict[str, Any]:
    """A compute mapping without the `experts` axis: under expert parallelism each device routes its tokens over
    every expert (the router's output is whole), while the experts' weights stay split (expert_weights)."""
    return {name: target for name, target in mapping.items() if name != nt.nn.EXPERTS}


def compute_factors(layout: Layout) -> dict[str, int]:
    """Axis name -> the ways the compute mapping splits it (the tensor-parallel axes; the batch too)."""
    factors = {}
    for name, target in without_experts(layout.compute_mapping).items():
        parts = _parts(target, layout.shape)
        if parts > 1:
            factors[name] = parts
    return factors


def resize_static_axes(obj: Any, factors: dict[str, int]) -> Any:
    """obj with every Axis held in a module's static fields (a Linear's In and Out, an attention layer's heads)
    at its per-device compute size, so that the layers agree with their per-device weights. Named arrays and
    model configs are left as they are."""
    if isinstance(obj, nt.Axis):
        f = factors.get(obj.name, 1)
        return obj.resize(obj.size // f) if f > 1 and obj.size % f == 0 else obj
    if nt.is_named(obj) or isinstance(obj, jax.ShapeDtypeStruct):
        return obj
    if isinstance(obj, tuple | list):
        items = [resize_static_axes(x, factors) for x in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    if isinstance(obj, dict):
        return {k: resize_static_axes(v, factors) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, LmConfig):
        changed = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name, None)
            new = resize_static_axes(value, factors)
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
def quiet_divisibility() -> Iterator[None]:
    """partition_spec warns when an axis does not divide; the plan reports sizes, it need not warn per trace."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
