"""Sharding by axis name: logical-to-mesh axis mappings, constraints, placement and a mapping-aware jit."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeAlias

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._core import Axis, NamedArray, is_named

MeshAxes: TypeAlias = str | tuple[str, ...] | None
AxisMapping: TypeAlias = Mapping[str, MeshAxes]


@dataclass(frozen=True)
class _Context:
    mapping: AxisMapping | None = None
    mesh: Mesh | None = None


_CONTEXT: ContextVar[_Context | None] = ContextVar("named_tensors_axis_mapping", default=None)


def _current() -> _Context:
    return _CONTEXT.get() or _Context()


@contextlib.contextmanager
def axis_mapping(mapping: AxisMapping | None, *, mesh: Mesh | None = None) -> Iterator[None]:
    """Make `mapping` (logical axis name -> mesh axes) and `mesh` current; an inner block keeps the outer
    mesh when it gives none."""
    outer = _current()
    mapping = None if mapping is None else _checked_mapping(mapping)
    token = _CONTEXT.set(_Context(mapping, mesh if mesh is not None else outer.mesh))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_axis_mapping() -> AxisMapping | None:
    """The mapping set by the innermost `axis_mapping`, or None."""
    return _current().mapping


def current_mesh() -> Mesh | None:
    """The mesh set by the innermost `axis_mapping` that gave one, or None."""
    return _current().mesh


def make_mesh(shape: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with Auto axis types from {mesh axis name: size}; one size may be -1 for 'the rest'."""
    devices = list(jax.devices() if devices is None else devices)
    names = tuple(shape)
    sizes = [int(s) for s in shape.values()]
    if sizes.count(-1) > 1:
        raise ValueError(f"make_mesh: at most one axis may be -1 (the rest), got {dict(shape)}")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"make_mesh: axis sizes must be positive (or -1 once), got {dict(shape)}")
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"make_mesh: {len(devices)} devices cannot be split into {dict(shape)}: "
                f"{len(devices)} is not a multiple of {known}"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"make_mesh: the mesh {dict(zip(names, sizes, strict=True))} needs {math.prod(sizes)} devices, "
            f"but {len(devices)} are available; make the sizes multiply to {len(devices)} or use -1"
        )
    grid = np.array(devices, dtype=object).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _as_mesh_axes(value: MeshAxes, logical: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple | list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"Axis mapping for {logical!r} must be a mesh axis name, a tuple of them, or None; got {value!r}")


def _checked_mapping(mapping: AxisMapping) -> dict[str, MeshAxes]:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"An axis mapping is a dict of logical axis name -> mesh axes, got {mapping!r}")
    for logical, value in mapping.items():
        if not isinstance(logical, str):
            raise TypeError(f"Axis mapping keys are logical axis names (str), got {logical!r}")
        _as_mesh_axes(value, logical)
    return dict(mapping)


def partition_spec(axes: Sequence[Axis], mapping: AxisMapping, mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of an array with `axes` under `mapping` on `mesh`.

    An axis whose size its mesh axes do not divide is replicated, with a warning."""
    entries: list[tuple[str, ...] | str | None] = []
    used: dict[str, str] = {}
    for axis in axes:
        mesh_axes = _as_mesh_axes(mapping.get(axis.name), axis.name)
        for m in mesh_axes:
            if m not in mesh.shape:
                raise ValueError(
                    f"Axis mapping sends {axis.name!r} to mesh axis {m!r}, but the mesh has axes "
                    f"{tuple(mesh.axis_names)}"
                )
            if m in used:
                raise ValueError(
                    f"Axes {used[m]!r} and {axis.name!r} of one array both map to mesh axis {m!r}; "
                    "a mesh axis can shard only one dimension of an array. Map one of them to None, "
                    "or use separate parameter and compute mappings"
                )
        parts = math.prod(mesh.shape[m] for m in mesh_axes)
        if mesh_axes and axis.size % parts:
            warnings.warn(
                f"Axis {axis.name!r} of size {axis.size} is not divisible by mesh axes {mesh_axes} "
                f"(total size {parts}); it is replicated instead of sharded",
                stacklevel=3,
            )
            mesh_axes = ()
        for m in mesh_axes:
            used[m] = axis.name
        entries.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*entries)


def _resolve(mapping: AxisMapping | None, mesh: Mesh | None, what: str) -> tuple[AxisMapping, Mesh]:
    mapping = current_axis_mapping() if mapping is None else _checked_mapping(mapping)
    mesh = current_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError(f"{what} needs a mesh: pass mesh=, or call it inside nt.axis_mapping(..., mesh=mesh)")
    if mapping is None:
        raise ValueError(
            f"{what} needs an axis mapping: pass mapping=, or call it inside nt.axis_mapping(mapping, mesh=...)"
        )
    return mapping, mesh


def _is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _shardings_for(tree: Any, mapping: AxisMapping, mesh: Mesh) -> Any:
    """`tree` with each array replaced by its NamedSharding (NamedArrays keep their axes); None elsewhere."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x: Any) -> Any:
        if is_named(x):
            if not _is_array_like(x.array):
                return None
            sharding = NamedSharding(mesh, partition_spec(x.axes, mapping, mesh))
            # Same tree structure as the input, so that jit, device_put and tree maps pair them leaf by leaf.
            return NamedArray.tree_unflatten(x.axes, (sharding,))
        if _is_array_like(x):
            return replicated
        return None

    return jax.tree.map(one, tree, is_leaf=is_named)


def infer_sharding(tree: Any, mapping: AxisMapping | None = None, mesh: Mesh | None = None) -> Any:
    """The NamedSharding of every array in `tree` under `mapping` (default: the current one).

    The result has the structure of `tree`: each NamedArray holds its NamedSharding in place of its array
    (`.array`), plain arrays become replicated shardings and other leaves None, so it can be passed to
    jax.jit or jax.device_put, or mapped over together with `tree`."""
    mapping, mesh = _resolve(mapping, mesh, "infer_sharding")
    return _shardings_for(tree, mapping, mesh)


def shard(x: Any, mapping: AxisMapping | None = None, mesh: Mesh | None = None) -> Any:
    """Constrain every NamedArray in `x` to the sharding its axis names map to (a no-op without a mesh
    or a mapping); inside jit this is a sharding constraint, outside it moves the data."""
    mapping = current_axis_mapping() if mapping is None else _checked_mapping(mapping)
    mesh = current_mesh() if mesh is None else mesh
    if mapping is None or mesh is None:
        return x

    def one(leaf: Any) -> Any:
        if is_named(leaf) and eqx.is_array(leaf.array):
            sharding = NamedSharding(mesh, partition_spec(leaf.axes, mapping, mesh))
            return NamedArray(jax.lax.with_sharding_constraint(leaf.array, sharding), leaf.axes)
        return leaf

    return jax.tree.map(one, x, is_leaf=is_named)


def shard_tree(tree: Any, mapping: AxisMapping | None = None, mesh: Mesh | None = None) -> Any:
    """Place every array of `tree` on the mesh as `mapping` says (plain arrays replicated)."""
    mapping, mesh = _resolve(mapping, mesh, "shard_tree")
    arrays, rest = eqx.partition(tree, eqx.is_array)
    placed = jax.device_put(arrays, _shardings_for(arrays, mapping, mesh))
    return eqx.combine(placed, rest)


def _freeze(mapping: AxisMapping | None) -> Any:
    if mapping is None:
        return None
    return tuple(sorted((k, tuple(_as_mesh_axes(v, k))) for k, v in mapping.items()))


ResourceSpec: TypeAlias = AxisMapping | Sequence[AxisMapping | None] | None


def _per_position(spec: ResourceSpec, n: int, default: AxisMapping, what: str) -> list[AxisMapping]:
    """One mapping per argument (or output element): a single mapping applies to all of them."""
    if spec is None:
        return [default] * n
    if isinstance(spec, Mapping):
        return [_checked_mapping(spec)] * n
    spec = list(spec)
    if len(spec) != n:
        raise ValueError(f"named_jit: {what} gives {len(spec)} mappings for {n} values; give one per value")
    return [default if m is None else _checked_mapping(m) for m in spec]


class _NamedJit:
    """A jitted function whose input and output shardings follow axis mappings."""

    def __init__(
        self,
        fn: Callable,
        in_axis_resources: ResourceSpec,
        out_axis_resources: ResourceSpec,
        axis_resources: AxisMapping | None,
        donate_args: bool | Sequence[bool],
        mesh: Mesh | None,
    ):
        self._fn = fn
        self._in = in_axis_resources
        self._out = out_axis_resources
        self._compute = None if axis_resources is None else _checked_mapping(axis_resources)
        self._donate = donate_args
        self._mesh = mesh
        self._cache: dict[Any, tuple[Callable, list]] = {}
        functools.update_wrapper(self, fn)

    def _donate_argnums(self, n_args: int) -> tuple[int, ...]:
        if isinstance(self._donate, bool):
            return tuple(range(n_args)) if self._donate else ()
        flags = list(self._donate)
        if len(flags) != n_args:
            raise ValueError(f"named_jit: donate_args gives {len(flags)} flags for {n_args} positional arguments")
        return tuple(i for i, f in enumerate(flags) if f)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mesh = self._mesh if self._mesh is not None else current_mesh()
        compute = self._compute if self._compute is not None else current_axis_mapping()
        if mesh is None or compute is None:
            raise ValueError(
                "named_jit needs a mesh and a compute mapping: pass mesh= and axis_resources=, or call the "
                "function inside nt.axis_mapping(mapping, mesh=mesh)"
            )
        in_maps = _per_position(self._in, len(args), compute, "in_axis_resources")
        dyn_args, static_args = eqx.partition(args, eqx.is_array)
        dyn_kwargs, static_kwargs = eqx.partition(kwargs, eqx.is_array)
        static_leaves, static_def = jax.tree.flatten((static_args, static_kwargs))
        try:
            key = (static_def, tuple(static_leaves), mesh, _freeze(compute), tuple(map(_freeze, in_maps)))
            hash(key)
        except TypeError as e:
            raise TypeError(f"named_jit: non-array arguments must be hashable (they are compiled in): {e}") from None
        arg_shardings = [_shardings_for(a, m, mesh) for a, m in zip(dyn_args, in_maps, strict=True)]
        in_shardings = (*arg_shardings, _shardings_for(dyn_kwargs, compute, mesh))
        # Arrays already placed as asked pass through; others move, since jit refuses a committed mismatch.
        placed = jax.device_put((*dyn_args, dyn_kwargs), in_shardings)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(static_args, static_kwargs, placed, in_shardings, compute, mesh)
            self._cache[key] = entry
        jitted, out_static = entry
        out_dyn = jitted(*placed)
        return eqx.combine(out_dyn, out_static[0])

    def _build(
        self,
        static_args: Any,
        static_kwargs: Any,
        placed: tuple,
        in_shardings: tuple,
        compute: AxisMapping,
        mesh: Mesh,
    ) -> tuple[Callable, list]:
        out_static: list = [None]
        fn = self._fn

        def inner(*dyn: Any) -> Any:
            args = eqx.combine(dyn[:-1], static_args)
            kwargs = eqx.combine(dyn[-1], static_kwargs)
            with axis_mapping(compute, mesh=mesh):
                out = fn(*args, **kwargs)
            out_dyn, out_static[0] = eqx.partition(out, eqx.is_array)
            return out_dyn

        out_shape = jax.eval_shape(inner, *placed)
        if self._out is None or isinstance(self._out, Mapping):
            out_map = compute if self._out is None else _checked_mapping(self._out)
            out_shardings = _shardings_for(out_shape, out_map, mesh)
        else:
            if not isinstance(out_shape, tuple):
                raise ValueError("named_jit: out_axis_resources is a sequence, so the function must return a tuple")
            out_maps = _per_position(self._out, len(out_shape), compute, "out_axis_resources")
            out_shardings = tuple(_shardings_for(o, m, mesh) for o, m in zip(out_shape, out_maps, strict=True))
        jitted = jax.jit(
            inner,
            in_shardings=in_shardings,
            out_shardings=out_shardings,
            donate_argnums=self._donate_argnums(len(placed) - 1),
        )
        return jitted, out_static


def named_jit(
    fn: Callable | None = None,
    *,
    in_axis_resources: ResourceSpec = None,
    out_axis_resources: ResourceSpec = None,
    axis_resources: AxisMapping | None = None,
    donate_args: bool | Sequence[bool] = False,
    mesh: Mesh | None = None,
) -> Callable:
    """jit whose shardings come from axis mappings.

    `axis_resources` is the compute mapping, current while `fn` runs (default: the mapping current at call
    time); `in_axis_resources` places the arguments and `out_axis_resources` the results (default: the
    compute mapping). Either may be one mapping for all, or a sequence of mappings, one per positional
    argument / per element of a returned tuple. `donate_args`: True, or one flag per positional argument."""
    if fn is None:
        return functools.partial(
            named_jit,
            in_axis_resources=in_axis_resources,
            out_axis_resources=out_axis_resources,
            axis_resources=axis_resources,
            donate_args=donate_args,
            mesh=mesh,
        )
    return _NamedJit(fn, in_axis_resources, out_axis_resources, axis_resources, donate_args, mesh)


__all__ = [
    "AxisMapping",
    "MeshAxes",
    "axis_mapping",
    "current_axis_mapping",
    "current_mesh",
    "infer_sharding",
    "make_mesh",
    "named_jit",
    "partition_spec",
    "shard",
    "shard_tree",
]
