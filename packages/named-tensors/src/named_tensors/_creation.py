"""Arrays built from axes: zeros, ones, full, arange and the *_like forms."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from ._core import Axis, AxisSpec, NamedArray, as_axis_tuple, check_unique


def _axes_of(axes: AxisSpec, fn_name: str) -> tuple[Axis, ...]:
    resolved = as_axis_tuple(axes)
    for a in resolved:
        if not isinstance(a, Axis):
            raise TypeError(f"{fn_name} needs Axis objects (name and size), got {a!r} in {resolved}")
    check_unique(resolved)
    return resolved  # type: ignore[return-value]


def _shape(axes: tuple[Axis, ...]) -> tuple[int, ...]:
    return tuple(a.size for a in axes)


def zeros(axes: AxisSpec, dtype: DTypeLike | None = None) -> NamedArray:
    """An array of zeros over `axes` (float32 unless dtype is given)."""
    resolved = _axes_of(axes, "zeros")
    return NamedArray(jnp.zeros(_shape(resolved), dtype=dtype), resolved)


def ones(axes: AxisSpec, dtype: DTypeLike | None = None) -> NamedArray:
    """An array of ones over `axes` (float32 unless dtype is given)."""
    resolved = _axes_of(axes, "ones")
    return NamedArray(jnp.ones(_shape(resolved), dtype=dtype), resolved)


def full(axes: AxisSpec, fill_value: Any, dtype: DTypeLike | None = None) -> NamedArray:
    """An array over `axes` filled with `fill_value` (dtype from the value unless given)."""
    resolved = _axes_of(axes, "full")
    if isinstance(fill_value, NamedArray):
        raise TypeError("full takes a scalar fill_value; to spread a NamedArray over axes, use nt.broadcast_to")
    return NamedArray(jnp.full(_shape(resolved), fill_value, dtype=dtype), resolved)


def _arange_dtype(start: Any, step: Any) -> jnp.dtype:
    arrays = [v for v in (start, step) if hasattr(v, "dtype")]
    if arrays:
        return jnp.result_type(*arrays)
    if any(isinstance(v, float) for v in (start, step)):
        return jax.dtypes.canonicalize_dtype(float)
    return jax.dtypes.canonicalize_dtype(int)


def arange(axis: Axis, *, start: Any = 0, step: Any = 1, dtype: DTypeLike | None = None) -> NamedArray:
    """start, start + step, ... : one value per position of `axis` (start and step may be traced)."""
    if not isinstance(axis, Axis):
        raise TypeError(f"arange needs an Axis (name and size), got {axis!r}")
    dtype = _arange_dtype(start, step) if dtype is None else jnp.dtype(dtype)
    # start + step * i, not jnp.arange(start, stop, step): the length must be exactly axis.size even when
    # floating-point rounding would put `stop` on the wrong side.
    values = jnp.arange(axis.size, dtype=dtype) * jnp.asarray(step, dtype) + jnp.asarray(start, dtype)
    return NamedArray(values, (axis,))


def _check_named(x: Any, fn_name: str) -> NamedArray:
    if not isinstance(x, NamedArray):
        raise TypeError(f"{fn_name} takes a NamedArray, got {type(x).__name__}")
    return x


def zeros_like(x: NamedArray, dtype: DTypeLike | None = None) -> NamedArray:
    """Zeros with x's axes and (unless given) dtype."""
    x = _check_named(x, "zeros_like")
    return NamedArray(jnp.zeros_like(x.array, dtype=dtype), x.axes)


def ones_like(x: NamedArray, dtype: DTypeLike | None = None) -> NamedArray:
    """Ones with x's axes and (unless given) dtype."""
    x = _check_named(x, "ones_like")
    return NamedArray(jnp.ones_like(x.array, dtype=dtype), x.axes)


def full_like(x: NamedArray, fill_value: Any, dtype: DTypeLike | None = None) -> NamedArray:
    """`fill_value` everywhere, with x's axes and (unless given) dtype."""
    x = _check_named(x, "full_like")
    return NamedArray(jnp.full_like(x.array, fill_value, dtype=dtype), x.axes)


__all__ = ["arange", "full", "full_like", "ones", "ones_like", "zeros", "zeros_like"]
