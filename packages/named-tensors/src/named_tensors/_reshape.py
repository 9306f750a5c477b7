"""Changing axes without a spec string: flatten and unflatten, split, concatenate, stack."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._core import Axis, AxisSelector, NamedArray, _describe, axis_name, check_unique, permute, union_axes

__all__ = ["concatenate", "flatten_axes", "split", "stack", "unflatten_axis"]


def flatten_axes(x: NamedArray, axes: Sequence[AxisSelector], new_axis: AxisSelector) -> NamedArray:
    """Merge `axes` (in the given order) into one axis that takes the place of the first of them in x."""
    axes = list(axes)
    if not axes:
        raise ValueError("flatten_axes needs at least one axis to merge")
    names = [axis_name(a) for a in axes]
    check_unique(names)
    resolved = [x.resolve_axis(a) for a in axes]
    size = math.prod(a.size for a in resolved)
    merged = new_axis if isinstance(new_axis, Axis) else Axis(axis_name(new_axis), size)
    if merged.size != size:
        raise ValueError(
            f"flatten_axes: merging {_describe(resolved)} gives size {size}, but new axis {merged.name!r} "
            f"has size {merged.size}"
        )
    first = min(x.axis_index(n) for n in names)
    others = [a for a in x.axes if a.name not in names]
    position = sum(1 for a in x.axes[:first] if a.name not in names)
    order = [a.name for a in others[:position]] + names + [a.name for a in others[position:]]
    moved = permute(x, order)
    out_axes = [*others[:position], merged, *others[position:]]
    return NamedArray(jnp.reshape(moved.array, tuple(a.size for a in out_axes)), out_axes)


def _new_axes(new_axes: Sequence[Axis], fn: str) -> list[Axis]:
    """The new axes as a list, each checked to be an Axis with a size."""
    new_axes = list(new_axes)
    for a in new_axes:
        if not isinstance(a, Axis):
            raise TypeError(f"{fn} needs Axis objects (with sizes), got {a!r}")
    return new_axes


def unflatten_axis(x: NamedArray, axis: AxisSelector, new_axes: Sequence[Axis]) -> NamedArray:
    """Split one axis of x, in place, into `new_axes` whose sizes multiply to its size."""
    new_axes = _new_axes(new_axes, "unflatten_axis")
    i = x.axis_index(axis)
    old = x.axes[i]
    size = math.prod(a.size for a in new_axes)
    if size != old.size:
        raise ValueError(
            f"unflatten_axis: axis {old.name!r} has size {old.size}, but {_describe(new_axes)} multiply to {size}"
        )
    out_axes = [*x.axes[:i], *new_axes, *x.axes[i + 1 :]]
    check_unique(out_axes)
    return NamedArray(jnp.reshape(x.array, tuple(a.size for a in out_axes)), out_axes)


def split(x: NamedArray, axis: AxisSelector, new_axes: Sequence[Axis]) -> list[NamedArray]:
    """Cut x along `axis` into consecutive pieces; piece i has that axis replaced by new_axes[i]."""
    new_axes = _new_axes(new_axes, "split")
    i = x.axis_index(axis)
    old = x.axes[i]
    total = sum(a.size for a in new_axes)
    if total != old.size:
        raise ValueError(
            f"split: axis {old.name!r} has size {old.size}, but the pieces {_describe(new_axes)} add up to {total}"
        )
    pieces = []
    start = 0
    for a in new_axes:
        piece_axes = [*x.axes[:i], a, *x.axes[i + 1 :]]
        check_unique(piece_axes)
        part = jax.lax.slice_in_dim(x.array, start, start + a.size, axis=i)
        pieces.append(NamedArray(part, piece_axes))
        start += a.size
    return pieces


def _align_others(arrays: Sequence[NamedArray], skip: str | None, what: str) -> list[str]:
    """Check that every array has the same axes (except `skip`) with equal sizes; return the first's order."""
    if not arrays:
        raise ValueError(f"{what} needs at least one array")
    for a in arrays:
        if not isinstance(a, NamedArray):
            raise TypeError(f"{what} takes NamedArrays, got {type(a).__name__}")
    reference = [a for a in arrays[0].axes if a.name != skip]
    for arr in arrays[1:]:
        others = [a for a in arr.axes if a.name != skip]
        if {a.name for a in others} != {a.name for a in reference}:
            raise ValueError(
                f"{what}: arrays have different axes, {_describe(arrays[0].axes)} and {_describe(arr.axes)}"
                + (f" (besides {skip!r})" if skip else "")
            )
        union_axes(reference, others)
    return [a.name for a in reference]


def concatenate(axis: AxisSelector, arrays: Sequence[NamedArray]) -> NamedArray:
    """Join arrays end to end along a named axis; their other axes are aligned by name."""
    arrays = list(arrays)
    name = axis_name(axis)
    for arr in arrays:
        if isinstance(arr, NamedArray) and not arr.has_axis(name):
            raise ValueError(f"concatenate: unknown axis {name!r} in an array with axes {_describe(arr.axes)}")
    others = _align_others(arrays, name, "concatenate")
    position = arrays[0].axis_index(name)
    order = [*others[:position], name, *others[position:]]
    aligned = [permute(a, order) for a in arrays]
    total = sum(a.axis_size(name) for a in arrays)
    if isinstance(axis, Axis) and axis.size != total:
        raise ValueError(f"concatenate: the pieces of axis {name!r} add up to {total}, not to {axis.size}")
    out_axes = [Axis(name, total) if n == name else arrays[0].resolve_axis(n) for n in order]
    return NamedArray(jnp.concatenate([a.array for a in aligned], axis=position), out_axes)


def stack(new_axis: AxisSelector, arrays: Sequence[NamedArray]) -> NamedArray:
    """Stack arrays along a new leading axis; their axes are aligned by name, not by position."""
    arrays = list(arrays)
    others = _align_others(arrays, None, "stack")
    name = axis_name(new_axis)
    if name in others:
        raise ValueError(f"stack: the new axis {name!r} already exists in the arrays' axes {_describe(arrays[0].axes)}")
    if isinstance(new_axis, Axis) and new_axis.size != len(arrays):
        raise ValueError(f"stack: new axis {name!r} has size {new_axis.size}, but {len(arrays)} arrays were given")
    aligned = [permute(a, others) for a in arrays]
    out_axes = [Axis(name, len(arrays)), *arrays[0].axes]
    return NamedArray(jnp.stack([a.array for a in aligned]), out_axes)
