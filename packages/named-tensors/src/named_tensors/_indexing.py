"""Indexing and slicing by axis name, dynamic slices, gathers, and the ops that move along one axis.

`x["position", 0:16]`, `x["batch", 3]` and `x[{"batch": 0, "position": nt.ds(start, 4)}]` select by name.
An integer drops its axis; a slice or `nt.ds` keeps the axis with its new size; an integer NamedArray
gathers: its axes replace the indexed axis, and any of its axes that the array also has (not indexed)
are matched element by element, as broadcasting by name would. Out-of-range array indices are clamped,
as in jax.numpy. `x.at[...]` takes the same selections for functional updates (set, add, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ._core import (
    Axis,
    AxisSelection,
    AxisSelector,
    NamedArray,
    _describe,
    as_axis_tuple,
    axis_name,
    broadcast_to,
    check_unique,
    permute,
    union_axes,
)


@dataclass(frozen=True)
class DynamicSlice:
    """`size` consecutive positions from a (possibly traced) `start`."""

    start: ArrayLike
    size: int


def ds(start: ArrayLike, size: int) -> DynamicSlice:
    """A dynamic slice for indexing: `x["position", nt.ds(start, 16)]` (start may be traced)."""
    if isinstance(size, bool) or not isinstance(size, int | np.integer) or size < 0:
        raise TypeError(f"ds needs a static non-negative int size, got {size!r}")
    return DynamicSlice(start, int(size))


Index: TypeAlias = int | slice | DynamicSlice | NamedArray | jax.Array
Selection: TypeAlias = Mapping[AxisSelector, Index]


def _pairs(key: Any) -> list[tuple[AxisSelector, Any]]:
    if isinstance(key, Mapping):
        return list(key.items())
    if isinstance(key, tuple) and len(key) % 2 == 0 and key:
        pairs = list(zip(key[0::2], key[1::2], strict=True))
        if all(isinstance(sel, str | Axis) for sel, _ in pairs):
            return pairs
    raise TypeError(f"A NamedArray is indexed by name, as x['axis', index] or x[{{'axis': index, ...}}]; got {key!r}")


def _static_int(index: Any) -> int | None:
    if isinstance(index, bool | np.bool_):
        return None
    if isinstance(index, int | np.integer):
        return int(index)
    return None


def index(x: NamedArray, selection: Selection) -> NamedArray:
    """Select from x by axis name: {axis: int | slice | nt.ds(...) | integer NamedArray}."""
    if not isinstance(x, NamedArray):
        raise TypeError(f"index takes a NamedArray, got {type(x).__name__}")
    pairs = list(selection.items())
    check_unique([sel for sel, _ in pairs])
    arr = x.array
    axes = list(x.axes)
    gathers: dict[int, Any] = {}
    for sel, idx in pairs:
        pos = x.axis_index(sel)
        ax = axes[pos]
        if isinstance(idx, slice):
            arr = arr[(slice(None),) * pos + (idx,)]
            axes[pos] = ax.resize(len(range(*idx.indices(ax.size))))
        elif isinstance(idx, DynamicSlice):
            if idx.size > ax.size:
                raise ValueError(f"Dynamic slice of size {idx.size} is longer than axis {ax.name!r}={ax.size}")
            arr = jax.lax.dynamic_slice_in_dim(arr, jnp.asarray(idx.start, jnp.int32), idx.size, axis=pos)
            axes[pos] = ax.resize(idx.size)
        elif (i := _static_int(idx)) is not None:
            if not -ax.size <= i < ax.size:
                raise IndexError(f"Index {i} is out of range for axis {ax.name!r} of size {ax.size}")
            gathers[pos] = i % ax.size
        elif isinstance(idx, NamedArray):
            if not jnp.issubdtype(idx.dtype, jnp.integer):
                raise TypeError(
                    f"Index for axis {ax.name!r} must hold integers, got dtype {idx.dtype} "
                    "(boolean masks would give data-dependent shapes: use nt.where)"
                )
            gathers[pos] = idx
        elif getattr(idx, "ndim", None) == 0 and jnp.issubdtype(idx.dtype, jnp.integer):  # pyright: ignore[reportAttributeAccessIssue] (0-d: an array)
            gathers[pos] = idx
        else:
            shape = getattr(idx, "shape", None)
            raise TypeError(
                f"Index for axis {ax.name!r} must be an int, a slice, nt.ds(start, size) or an integer "
                f"NamedArray; got {type(idx).__name__}"
                + (f" of shape {shape}: name its axes with nt.named" if shape else "")
            )
    if not gathers:
        return NamedArray(arr, axes)
    if not any(isinstance(g, NamedArray) for g in gathers.values()):
        # Only scalar indices: plain indexing drops those axes and keeps the others in order.
        key = tuple(gathers.get(p, slice(None)) for p in range(len(axes)))
        return NamedArray(arr[key], [a for p, a in enumerate(axes) if p not in gathers])
    return _gather(arr, axes, gathers)


def _gather(arr: jax.Array, axes: list[Axis], gathers: dict[int, Any]) -> NamedArray:
    index_arrays = {p: g if isinstance(g, NamedArray) else NamedArray(jnp.asarray(g), ()) for p, g in gathers.items()}
    index_axes = union_axes(*(g.axes for g in index_arrays.values()))
    indexed_names = {axes[p].name for p in gathers}
    untouched = [a for a in axes if a.name not in indexed_names]
    index_names = {a.name for a in index_axes}
    shared = [a for a in untouched if a.name in index_names]
    index_sizes = {a.name: a.size for a in index_axes}
    for a in shared:
        if index_sizes[a.name] != a.size:
            raise ValueError(
                f"The index for axis {sorted(indexed_names)} has axis {a.name!r} of size "
                f"{index_sizes[a.name]}, but the indexed array's {a.name!r} has size {a.size}: "
                "axes shared by an index and the array are matched element by element"
            )
    kept = [a for a in untouched if a.name not in index_names]
    position = {a.name: p for p, a in enumerate(axes)}
    # Lay x out as (shared, indexed, kept): the advanced indices then sit together in front, so the result
    # is (index axes, kept) without numpy's rules for moving separated advanced indices.
    order = [position[a.name] for a in shared] + sorted(gathers) + [position[a.name] for a in kept]
    laid_out = jnp.transpose(arr, order)
    rank = len(index_axes)
    index_position = {a.name: i for i, a in enumerate(index_axes)}
    key = []
    for a in shared:
        shape = [1] * rank
        shape[index_position[a.name]] = a.size
        key.append(jnp.arange(a.size, dtype=jnp.int32).reshape(shape))
    for p in sorted(gathers):
        key.append(broadcast_to(index_arrays[p], index_axes).array.astype(jnp.int32))
    result = NamedArray(laid_out[tuple(key)], (*index_axes, *kept))
    # Put the new axes where the (first) indexed axis was, and keep x's order for the rest.
    shared_names = {a.name for a in shared}
    new_axes = [a.name for a in index_axes if a.name not in shared_names]
    final: list[str] = []
    for p, a in enumerate(axes):
        if p in gathers:
            if p == min(gathers):
                final.extend(new_axes)
        else:
            final.append(a.name)
    return permute(result, final)


def _getitem(self: NamedArray, key: Any) -> NamedArray:
    return index(self, dict(_pairs(key)))


NamedArray.__getitem__ = _getitem


class IndexUpdateRef:
    """The selection `x.at[...]`, to be read with get() or written with set/add/multiply/min/max."""

    def __init__(self, x: NamedArray, selection: Selection):
        self._x = x
        self._selection = selection

    def get(self) -> NamedArray:
        """The selected values, as x[...] gives them."""
        return index(self._x, self._selection)

    def set(self, values: NamedArray | ArrayLike) -> NamedArray:
        """x with the selection replaced by `values` (broadcast by name to the selection's axes)."""
        return self._scatter("set", values)

    def add(self, values: NamedArray | ArrayLike) -> NamedArray:
        """x with `values` added to the selection (repeated indices accumulate)."""
        return self._scatter("add", values)

    def multiply(self, values: NamedArray | ArrayLike) -> NamedArray:
        """x with the selection multiplied by `values`."""
        return self._scatter("multiply", values)

    def min(self, values: NamedArray | ArrayLike) -> NamedArray:
        """x with the selection lowered to `values` where they are smaller."""
        return self._scatter("min", values)

    def max(self, values: NamedArray | ArrayLike) -> NamedArray:
        """x with the selection raised to `values` where they are larger."""
        return self._scatter("max", values)

    def _scatter(self, method: str, values: NamedArray | ArrayLike) -> NamedArray:
        x = self._x
        if x.size >= 2**31:
            raise ValueError(f"x.at[...] supports arrays of fewer than 2**31 elements; x has axes {_describe(x.axes)}")
        # Select flat positions with the very rules of x[...], then scatter into the flattened array.
        positions = NamedArray(jnp.arange(x.size, dtype=jnp.int32).reshape(x.array.shape), x.axes)
        targets = index(positions, self._selection)
        if isinstance(values, NamedArray):
            extra = [a.name for a in values.axes if a.name not in {t.name for t in targets.axes}]
            if extra:
                raise ValueError(
                    f"x.at[...].{method}: values have axes {extra} that the selection "
                    f"{_describe(targets.axes)} does not have"
                )
            flat_values = broadcast_to(values, targets.axes).array.astype(x.dtype).reshape(-1)
        elif getattr(values, "ndim", 0) == 0:
            flat_values = jnp.broadcast_to(jnp.asarray(values, x.dtype), (targets.size,))
        else:
            raise TypeError(
                f"x.at[...].{method}: values must be a scalar or a NamedArray, got an unnamed array of shape "
                f"{getattr(values, 'shape', None)}; name its axes with nt.named"
            )
        updated = getattr(x.array.reshape(-1).at[targets.array.reshape(-1)], method)(flat_values)
        return NamedArray(updated.reshape(x.array.shape), x.axes)


class _IndexUpdateHelper:
    def __init__(self, x: NamedArray):
        self._x = x

    def __getitem__(self, key: Any) -> IndexUpdateRef:
        return IndexUpdateRef(self._x, dict(_pairs(key)))


# setattr: NamedArray declares `at` as a property for type checkers, and a property cannot be assigned by name.
setattr(  # noqa: B010
    NamedArray, "at", property(_IndexUpdateHelper, doc="Functional updates by name: x.at['position', 0:4].set(v).")
)


def take(x: NamedArray, axis: AxisSelector, indices: NamedArray | int) -> NamedArray:
    """Gather along `axis`: the indices' axes replace it (an int drops it)."""
    return index(x, {axis: indices})


def dynamic_slice(
    x: NamedArray, start: Mapping[AxisSelector, ArrayLike], size: Mapping[AxisSelector, int]
) -> NamedArray:
    """`size[axis]` positions from (possibly traced) `start[axis]` along each named axis."""
    start_names = {axis_name(a): s for a, s in start.items()}
    size_names = {axis_name(a): n for a, n in size.items()}
    if start_names.keys() != size_names.keys():
        raise ValueError(
            f"dynamic_slice needs a start and a size for the same axes; got starts for "
            f"{sorted(start_names)} and sizes for {sorted(size_names)}"
        )
    return index(x, {name: ds(s, size_names[name]) for name, s in start_names.items()})


def dynamic_update_slice(x: NamedArray, update: NamedArray, start: Mapping[AxisSelector, ArrayLike]) -> NamedArray:
    """x with `update` written from `start` (axes not in start: 0; x's axes missing from update: all of it).

    The update is cast to x's dtype.
    """
    x_names = {a.name for a in x.axes}
    foreign = [a.name for a in update.axes if a.name not in x_names]
    if foreign:
        raise ValueError(f"dynamic_update_slice: update has axes {foreign} that x {_describe(x.axes)} does not have")
    for a in update.axes:
        if a.size > x.axis_size(a.name):
            raise ValueError(
                f"dynamic_update_slice: update's axis {a.name!r}={a.size} is longer than x's "
                f"{a.name!r}={x.axis_size(a.name)}"
            )
    update_axes = {a.name: a for a in update.axes}
    target = tuple(update_axes.get(a.name, a) for a in x.axes)
    upd = broadcast_to(update, target).array.astype(x.dtype)
    starts_by_name = {axis_name(a): s for a, s in start.items()}
    for name in starts_by_name:
        x.axis_index(name)
    starts = [jnp.asarray(starts_by_name.get(a.name, 0), jnp.int32) for a in x.axes]
    return NamedArray(jax.lax.dynamic_update_slice(x.array, upd, starts), x.axes)


def pad(
    x: NamedArray,
    widths: Mapping[AxisSelector, int | tuple[int, int]],
    *,
    mode: str = "constant",
    constant_values: Any = 0,
) -> NamedArray:
    """Pad the named axes by (before, after) positions (an int pads both sides); the axes grow."""
    per_axis = {}
    for sel, w in widths.items():
        before, after = (w, w) if isinstance(w, int) else tuple(w)
        if before < 0 or after < 0:
            raise ValueError(f"pad widths must be non-negative, got {w!r} for axis {axis_name(sel)!r}")
        per_axis[x.axis_index(sel)] = (before, after)
    pad_width = [per_axis.get(p, (0, 0)) for p in range(x.ndim)]
    kwargs = {"constant_values": constant_values} if mode == "constant" else {}
    arr = jnp.pad(x.array, pad_width, mode=mode, **kwargs)
    axes = [a.resize(a.size + sum(pad_width[p])) for p, a in enumerate(x.axes)]
    return NamedArray(arr, axes)


def roll(x: NamedArray, shift: int | Sequence[int], axis: AxisSelection) -> NamedArray:
    """Shift elements along the named axes, wrapping around (one shift per axis, or one for all)."""
    positions = tuple(x.axis_index(a) for a in as_axis_tuple(axis))
    check_unique([x.axes[p] for p in positions])
    return NamedArray(jnp.roll(x.array, shift, axis=positions), x.axes)


def top_k(
    x: NamedArray, axis: AxisSelector, k: int, new_axis: AxisSelector | None = None
) -> tuple[NamedArray, NamedArray]:
    """The k largest values along `axis` and their indices; the axis becomes `new_axis` (default: same)."""
    pos = x.axis_index(axis)
    ax = x.axes[pos]
    if not 0 <= k <= ax.size:
        raise ValueError(f"top_k: k={k} must be between 0 and the size of axis {ax.name!r}={ax.size}")
    out_axis = Axis(ax.name if new_axis is None else axis_name(new_axis), k)
    if isinstance(new_axis, Axis) and new_axis.size != k:
        raise ValueError(f"top_k: new axis {new_axis!r} must have size k={k}")
    values, indices = jax.lax.top_k(jnp.moveaxis(x.array, pos, -1), k)
    axes = [*x.axes[:pos], out_axis, *x.axes[pos + 1 :]]
    return NamedArray(jnp.moveaxis(values, -1, pos), axes), NamedArray(jnp.moveaxis(indices, -1, pos), axes)


def _scan_along(fn, x: NamedArray, axis: AxisSelector, reverse: bool, dtype: Any) -> NamedArray:
    pos = x.axis_index(axis)
    arr = jnp.flip(x.array, pos) if reverse else x.array
    out = fn(arr, axis=pos, dtype=dtype)
    return NamedArray(jnp.flip(out, pos) if reverse else out, x.axes)


def cumsum(x: NamedArray, axis: AxisSelector, *, reverse: bool = False, dtype: Any = None) -> NamedArray:
    """Running sum along `axis` (from the end when reverse=True)."""
    return _scan_along(jnp.cumsum, x, axis, reverse, dtype)


def cumprod(x: NamedArray, axis: AxisSelector, *, reverse: bool = False, dtype: Any = None) -> NamedArray:
    """Running product along `axis` (from the end when reverse=True)."""
    return _scan_along(jnp.cumprod, x, axis, reverse, dtype)


def sort(x: NamedArray, axis: AxisSelector, *, descending: bool = False) -> NamedArray:
    """Values sorted along `axis`."""
    return NamedArray(jnp.sort(x.array, axis=x.axis_index(axis), descending=descending), x.axes)


def argsort(x: NamedArray, axis: AxisSelector, *, descending: bool = False) -> NamedArray:
    """Indices that sort x along `axis` (stable: ties keep their order)."""
    order = jnp.argsort(x.array, axis=x.axis_index(axis), stable=True, descending=descending)
    return NamedArray(order, x.axes)


__all__ = [
    "DynamicSlice",
    "IndexUpdateRef",
    "argsort",
    "cumprod",
    "cumsum",
    "ds",
    "dynamic_slice",
    "dynamic_update_slice",
    "index",
    "pad",
    "roll",
    "sort",
    "take",
    "top_k",
]
