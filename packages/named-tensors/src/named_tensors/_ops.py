"""Reductions, activations, normalisers and selection over named axes."""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._core import (
    AxisSelection,
    AxisSelector,
    NamedArray,
    as_axis_tuple,
    axis_name,
    broadcast_to,
    elementwise,
)


def _reduction_positions(x: NamedArray, axis: AxisSelection | None) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(x.ndim))
    positions = tuple(x.axis_index(a) for a in as_axis_tuple(axis))
    if len(set(positions)) != len(positions):
        raise ValueError(f"Axis named twice in reduction: {[axis_name(a) for a in as_axis_tuple(axis)]}")
    return positions


def _reducer(fn: Callable[..., jax.Array], name: str) -> Callable[..., NamedArray]:
    def reduce(x: NamedArray, axis: AxisSelection | None = None, *, where: NamedArray | None = None, **kw: Any):
        positions = _reduction_positions(x, axis)
        kept = [a for i, a in enumerate(x.axes) if i not in positions]
        if where is not None:
            where = _aligned_mask(where, x)
            kw["where"] = where.array
        return NamedArray(fn(x.array, axis=positions, **kw), kept)

    reduce.__name__ = name
    reduce.__doc__ = f"{name} over the named axes (None: all axes); the other axes are kept."
    return reduce


def _aligned_mask(mask: NamedArray, x: NamedArray) -> NamedArray:
    return broadcast_to(mask, x.axes)


sum = _reducer(jnp.sum, "sum")
mean = _reducer(jnp.mean, "mean")
max = _reducer(jnp.max, "max")
min = _reducer(jnp.min, "min")
prod = _reducer(jnp.prod, "prod")
std = _reducer(jnp.std, "std")
var = _reducer(jnp.var, "var")
all = _reducer(jnp.all, "all")
any = _reducer(jnp.any, "any")


def _arg_reducer(fn: Callable[..., jax.Array], name: str) -> Callable[..., NamedArray]:
    def reduce(x: NamedArray, axis: AxisSelector | None) -> NamedArray:
        if axis is None:
            return NamedArray(fn(x.array.reshape(-1)), ())
        i = x.axis_index(axis)
        return NamedArray(fn(x.array, axis=i), [a for j, a in enumerate(x.axes) if j != i])

    reduce.__name__ = name
    reduce.__doc__ = f"Index of the {name[3:]} along one named axis (None: flat index over all axes)."
    return reduce


argmax = _arg_reducer(jnp.argmax, "argmax")
argmin = _arg_reducer(jnp.argmin, "argmin")


def _unary(fn: Callable[[jax.Array], jax.Array], name: str) -> Callable[[NamedArray], NamedArray]:
    def apply(x: NamedArray) -> NamedArray:
        if not isinstance(x, NamedArray):
            raise TypeError(f"{name} takes a NamedArray, got {type(x).__name__}")
        return NamedArray(fn(x.array), x.axes)

    apply.__name__ = name
    apply.__doc__ = f"Elementwise {name}."
    return apply


relu = _unary(jax.nn.relu, "relu")
silu = _unary(jax.nn.silu, "silu")
sigmoid = _unary(jax.nn.sigmoid, "sigmoid")
tanh = _unary(jnp.tanh, "tanh")
exp = _unary(jnp.exp, "exp")
log = _unary(jnp.log, "log")
sqrt = _unary(jnp.sqrt, "sqrt")
rsqrt = _unary(jax.lax.rsqrt, "rsqrt")
square = _unary(jnp.square, "square")
abs = _unary(jnp.abs, "abs")
sin = _unary(jnp.sin, "sin")
cos = _unary(jnp.cos, "cos")
logical_not = _unary(jnp.logical_not, "logical_not")
isfinite = _unary(jnp.isfinite, "isfinite")
stop_gradient = _unary(jax.lax.stop_gradient, "stop_gradient")


def gelu(x: NamedArray, approximate: bool = True) -> NamedArray:
    """Elementwise GELU (tanh approximation by default, as GPT-2 uses)."""
    return NamedArray(jax.nn.gelu(x.array, approximate=approximate), x.axes)


def softmax(x: NamedArray, axis: AxisSelection) -> NamedArray:
    """Softmax over the named axes."""
    return NamedArray(jax.nn.softmax(x.array, axis=_reduction_positions(x, axis)), x.axes)


def log_softmax(x: NamedArray, axis: AxisSelection) -> NamedArray:
    """Log-softmax over the named axes."""
    return NamedArray(jax.nn.log_softmax(x.array, axis=_reduction_positions(x, axis)), x.axes)


def logsumexp(x: NamedArray, axis: AxisSelection | None = None) -> NamedArray:
    """log(sum(exp(x))) over the named axes, computed stably."""
    positions = _reduction_positions(x, axis)
    kept = [a for i, a in enumerate(x.axes) if i not in positions]
    return NamedArray(jax.nn.logsumexp(x.array, axis=positions), kept)


def where(condition: NamedArray | bool, x: NamedArray | Any, y: NamedArray | Any) -> NamedArray:
    """Elementwise choice between x and y, all broadcast by name."""
    if not builtins.any(isinstance(v, NamedArray) for v in (condition, x, y)):
        raise TypeError("where needs at least one NamedArray among condition, x and y")
    return elementwise(jnp.where, condition, x, y, op_name="where")


def clip(x: NamedArray, lo: NamedArray | Any, hi: NamedArray | Any) -> NamedArray:
    """Clamp x to [lo, hi], with bounds broadcast by name."""
    return elementwise(lambda a, b, c: jnp.clip(a, b, c), x, lo, hi, op_name="clip")


def maximum(a: NamedArray | Any, b: NamedArray | Any) -> NamedArray:
    """Elementwise maximum, broadcast by name."""
    return elementwise(jnp.maximum, a, b, op_name="maximum")


def minimum(a: NamedArray | Any, b: NamedArray | Any) -> NamedArray:
    """Elementwise minimum, broadcast by name."""
    return elementwise(jnp.minimum, a, b, op_name="minimum")


__all__ = [
    "abs",
    "all",
    "any",
    "argmax",
    "argmin",
    "clip",
    "cos",
    "exp",
    "gelu",
    "isfinite",
    "log",
    "log_softmax",
    "logical_not",
    "logsumexp",
    "max",
    "maximum",
    "mean",
    "min",
    "minimum",
    "prod",
    "relu",
    "rsqrt",
    "sigmoid",
    "silu",
    "sin",
    "softmax",
    "sqrt",
    "square",
    "std",
    "stop_gradient",
    "sum",
    "tanh",
    "var",
    "where",
]
