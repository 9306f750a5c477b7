"""LayerNorm and RMSNorm over named axes, optionally computed in float32 and cast back."""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike

from .. import _ops as ops
from .._core import Axis, NamedArray
from ._checks import axes_tuple, require_axes


def _compute_dtype(x: NamedArray, upcast: bool) -> jnp.dtype:
    """float32 for low-precision floats when upcasting, else the input's own dtype."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"Normalisation needs a floating-point input, got dtype {x.dtype}")
    if upcast and jnp.finfo(x.dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(x.dtype)


def _scale_and_shift(
    y: NamedArray, weight: NamedArray | None, bias: NamedArray | None, out_dtype: DTypeLike
) -> NamedArray:
    # Parameters are cast to the compute dtype explicitly: strict dtype promotion forbids mixing.
    if weight is not None:
        y = y * weight.astype(y.dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y.astype(out_dtype)


class LayerNorm(eqx.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over `axis`; weight and bias each optional.

    Layout: `weight` and `bias` have the normalised axes. With `upcast`, inputs narrower than float32 are
    normalised (and scaled) in float32 and the result is cast back to the input dtype.
    """

    weight: NamedArray | None
    bias: NamedArray | None
    axis: tuple[Axis, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    upcast: bool = eqx.field(static=True)

    @staticmethod
    def init(
        axis: Axis | Sequence[Axis],
        *,
        eps: float = 1e-5,
        use_weight: bool = True,
        use_bias: bool = True,
        upcast: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> LayerNorm:
        """Weight ones, bias zeros."""
        axis = axes_tuple(axis, "LayerNorm.init axis")
        shape = tuple(a.size for a in axis)
        weight = NamedArray(jnp.ones(shape, dtype), axis) if use_weight else None
        bias = NamedArray(jnp.zeros(shape, dtype), axis) if use_bias else None
        return LayerNorm(weight, bias, axis, float(eps), upcast)

    def __call__(self, x: NamedArray) -> NamedArray:
        """Normalise x over the layer's axes; other axes are independent rows."""
        require_axes(x, self.axis, "LayerNorm")
        xc = x.astype(_compute_dtype(x, self.upcast))
        centred = xc - ops.mean(xc, self.axis)
        variance = ops.mean(ops.square(centred), self.axis)
        y = centred * ops.rsqrt(variance + self.eps)
        return _scale_and_shift(y, self.weight, self.bias, x.dtype)


class RMSNorm(eqx.Module):
    """x / sqrt(mean(x²) + eps) * (weight_offset + weight) over `axis` (no centring, no bias), as in Llama.

    Layout: `weight` has the normalised axes. `upcast` works as in LayerNorm. `weight_offset` is 0 for Llama and
    1 for Gemma, whose stored weight is the scale minus one (it starts at zero).
    """

    weight: NamedArray | None
    axis: tuple[Axis, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    upcast: bool = eqx.field(static=True)
    weight_offset: float = eqx.field(static=True, default=0.0)

    @staticmethod
    def init(
        axis: Axis | Sequence[Axis],
        *,
        eps: float = 1e-6,
        use_weight: bool = True,
        upcast: bool = True,
        dtype: DTypeLike = jnp.float32,
        weight_offset: float = 0.0,
    ) -> RMSNorm:
        """A scale of one: weight ones (zeros with weight_offset=1)."""
        axis = axes_tuple(axis, "RMSNorm.init axis")
        shape = tuple(a.size for a in axis)
        weight = NamedArray(jnp.full(shape, 1.0 - weight_offset, dtype), axis) if use_weight else None
        return RMSNorm(weight, axis, float(eps), upcast, float(weight_offset))

    def __call__(self, x: NamedArray) -> NamedArray:
        """Normalise x by its root mean square over the layer's axes."""
        require_axes(x, self.axis, "RMSNorm")
        xc = x.astype(_compute_dtype(x, self.upcast))
        y = xc * ops.rsqrt(ops.mean(ops.square(xc), self.axis) + self.eps)
        weight = self.weight
        if weight is not None and self.weight_offset:
            weight = weight.astype(y.dtype) + self.weight_offset
        return _scale_and_shift(y, weight, None, x.dtype)
