"""Random NamedArrays drawn from a jax PRNG key over named axes.

Every function is deterministic given its key. For a given key and axes in a given order, the result's
array equals what `jax.random` returns for the positional shape `tuple(a.size for a in axes)`; so the same
axes listed in another order give other numbers, not a transposed copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from ._core import Axis, AxisSelector, AxisSpec, NamedArray, _describe, axis_name, broadcast_to
from ._creation import _axes_of, _shape


def _spread(value: NamedArray | ArrayLike, axes: tuple[Axis, ...], what: str, fn_name: str) -> ArrayLike:
    """A parameter as a positional array laid out like `axes` (a NamedArray is broadcast by name)."""
    if isinstance(value, NamedArray):
        extra = [a.name for a in value.axes if a.name not in {b.name for b in axes}]
        if extra:
            raise ValueError(f"{fn_name}: {what} has axes {extra} that are not among the output axes {_describe(axes)}")
        return broadcast_to(value, axes).array
    if getattr(value, "ndim", 0) != 0:
        raise TypeError(
            f"{fn_name}: {what} must be a scalar or a NamedArray, got an unnamed array of shape "
            f"{getattr(value, 'shape', None)}; name its axes with nt.named"
        )
    return value


def normal(key: jax.Array, axes: AxisSpec, dtype: DTypeLike = jnp.float32) -> NamedArray:
    """Standard normal samples over `axes`."""
    resolved = _axes_of(axes, "normal")
    return NamedArray(jax.random.normal(key, _shape(resolved), dtype=dtype), resolved)


def uniform(
    key: jax.Array,
    axes: AxisSpec,
    dtype: DTypeLike = jnp.float32,
    minval: NamedArray | ArrayLike = 0.0,
    maxval: NamedArray | ArrayLike = 1.0,
) -> NamedArray:
    """Uniform samples in [minval, maxval) over `axes`; bounds may be NamedArrays, broadcast by name."""
    resolved = _axes_of(axes, "uniform")
    lo = _spread(minval, resolved, "minval", "uniform")
    hi = _spread(maxval, resolved, "maxval", "uniform")
    return NamedArray(jax.random.uniform(key, _shape(resolved), dtype=dtype, minval=lo, maxval=hi), resolved)


def randint(
    key: jax.Array,
    axes: AxisSpec,
    minval: NamedArray | ArrayLike,
    maxval: NamedArray | ArrayLike,
    dtype: DTypeLike = jnp.int32,
) -> NamedArray:
    """Integers in [minval, maxval) over `axes`; bounds may be NamedArrays, broadcast by name."""
    resolved = _axes_of(axes, "randint")
    lo = _spread(minval, resolved, "minval", "randint")
    hi = _spread(maxval, resolved, "maxval", "randint")
    return NamedArray(jax.random.randint(key, _shape(resolved), lo, hi, dtype=dtype), resolved)


def truncated_normal(
    key: jax.Array,
    axes: AxisSpec,
    lower: NamedArray | ArrayLike = -2.0,
    upper: NamedArray | ArrayLike = 2.0,
    dtype: DTypeLike = jnp.float32,
) -> NamedArray:
    """Standard normal samples cut to (lower, upper) over `axes`; bounds may be NamedArrays."""
    resolved = _axes_of(axes, "truncated_normal")
    lo = _spread(lower, resolved, "lower", "truncated_normal")
    hi = _spread(upper, resolved, "upper", "truncated_normal")
    return NamedArray(jax.random.truncated_normal(key, lo, hi, _shape(resolved), dtype=dtype), resolved)


def bernoulli(key: jax.Array, axes: AxisSpec, p: NamedArray | ArrayLike = 0.5) -> NamedArray:
    """Booleans over `axes`, True with probability p (p may be a NamedArray, broadcast by name)."""
    resolved = _axes_of(axes, "bernoulli")
    prob = _spread(p, resolved, "p", "bernoulli")
    return NamedArray(jax.random.bernoulli(key, prob, _shape(resolved)), resolved)


def categorical(key: jax.Array, logits: NamedArray, axis: AxisSelector, axes: AxisSpec | None = None) -> NamedArray:
    """Indices along `axis` drawn with probabilities softmax(logits) over that axis.

    The result has logits' other axes, or `axes` when given (logits' other axes are then broadcast to them
    by name). It equals `jax.random.categorical(key, L, axis=-1)` where L is logits laid out as
    (*result axes, axis).
    """
    if not isinstance(logits, NamedArray):
        raise TypeError(f"categorical takes logits as a NamedArray, got {type(logits).__name__}")
    choice_axis = logits.resolve_axis(axis)
    if axes is None:
        out_axes = tuple(a for a in logits.axes if a.name != choice_axis.name)
    else:
        out_axes = _axes_of(axes, "categorical")
        if choice_axis.name in {a.name for a in out_axes}:
            raise ValueError(
                f"categorical: the choice axis {choice_axis.name!r} cannot also be an output axis {_describe(out_axes)}"
            )
        out_names = {a.name for a in out_axes}
        missing = [a.name for a in logits.axes if a.name != choice_axis.name and a.name not in out_names]
        if missing:
            raise ValueError(
                f"categorical: logits have axes {missing} that are not among the output axes {_describe(out_axes)}"
            )
    laid_out = broadcast_to(logits, (*out_axes, choice_axis)).array
    return NamedArray(jax.random.categorical(key, laid_out, axis=-1, shape=_shape(out_axes)), out_axes)


def permutation(
    key: jax.Array, x: NamedArray | Axis, axis: AxisSelector | None = None, *, independent: bool = False
) -> NamedArray:
    """A random shuffle of x along `axis`; an Axis alone gives a shuffled arange over it.

    With independent=True each slice along the other axes is shuffled on its own.
    """
    if isinstance(x, Axis):
        if axis is not None and axis_name(axis) != x.name:
            raise ValueError(f"permutation of Axis {x.name!r} takes no other axis, got {axis!r}")
        return NamedArray(jax.random.permutation(key, x.size), (x,))
    if not isinstance(x, NamedArray):
        raise TypeError(f"permutation takes a NamedArray or an Axis, got {type(x).__name__}")
    if axis is None:
        raise ValueError(f"permutation of an array needs the axis to shuffle, one of {_describe(x.axes)}")
    position = x.axis_index(axis)
    return NamedArray(jax.random.permutation(key, x.array, axis=position, independent=independent), x.axes)


__all__ = [
    "bernoulli",
    "categorical",
    "normal",
    "permutation",
    "randint",
    "truncated_normal",
    "uniform",
]
