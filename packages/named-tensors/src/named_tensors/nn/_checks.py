"""Argument checks shared by the layers, with errors that say what to change."""

from __future__ import annotations

from collections.abc import Sequence

from .._core import Axis, AxisSelection, NamedArray, as_axis_tuple, axis_name


def axes_tuple(axes: Axis | Sequence[Axis], what: str) -> tuple[Axis, ...]:
    """One Axis or a sequence of them as a tuple of Axis (sizes are needed to build parameters)."""
    out = as_axis_tuple(axes)
    for a in out:
        if not isinstance(a, Axis):
            raise TypeError(f"{what} needs Axis objects with sizes, got {a!r}")
    return tuple(a for a in out if isinstance(a, Axis))  # all of them: the loop above checked


def require_axes(x: NamedArray, axes: AxisSelection, layer: str) -> None:
    """Raise unless x has every given axis (with the given size, when an Axis is given)."""
    if not isinstance(x, NamedArray):
        raise TypeError(f"{layer} takes a NamedArray, got {type(x).__name__}")
    for a in as_axis_tuple(axes):
        if not x.has_axis(a):
            raise ValueError(
                f"{layer} needs an input with axis {axis_name(a)!r}, but the input has axes {x.axis_names}"
            )
        x.axis_index(a)  # size check with a clear message


def require_same_dtype(x: NamedArray, param: NamedArray, layer: str) -> None:
    """Raise when input and parameters differ in dtype: mixed precision must cast explicitly."""
    if x.dtype != param.dtype:
        raise TypeError(
            f"{layer}: input dtype {x.dtype} differs from parameter dtype {param.dtype}; cast one of them "
            "first (e.g. with a mixed-precision policy that casts parameters to the compute dtype)"
        )
