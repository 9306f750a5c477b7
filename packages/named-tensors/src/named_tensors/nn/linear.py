"""Linear: a learned affine map from any set of named input axes to any set of named output axes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._core import Axis, NamedArray, dot
from ._checks import axes_tuple, require_axes, require_same_dtype


class Linear(eqx.Module):
    """y = x·W + b, contracting the In axes of x and adding the Out axes; other axes of x are kept.

    Layouts: `weight` has axes (*Out, *In) in that order, `bias` (when present) has axes Out.
    """

    weight: NamedArray
    bias: NamedArray | None
    In: tuple[Axis, ...] = eqx.field(static=True)
    Out: tuple[Axis, ...] = eqx.field(static=True)
    quant: Any = None
    """A quantized matmul (quantized_matmul.Fp8Matmul or Int8Matmul) called as quant(x, weight, In, Out) in
    place of the plain dot; None (the default) keeps the plain one and adds nothing to the tree."""

    @staticmethod
    def init(
        In: Axis | Sequence[Axis],
        Out: Axis | Sequence[Axis],
        *,
        key: jax.Array,
        use_bias: bool = True,
        init_scale: float = 1.0,
        scale_by_fan_in: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> Linear:
        """Weights ~ Normal(0, std), std = init_scale / sqrt(fan_in) (or init_scale); bias zero."""
        In = axes_tuple(In, "Linear.init In")
        Out = axes_tuple(Out, "Linear.init Out")
        if not In or not Out:
            raise ValueError(f"Linear needs at least one input and one output axis, got In={In}, Out={Out}")
        clash = sorted({a.name for a in In} & {a.name for a in Out})
        if clash:
            raise ValueError(
                f"Linear input and output axes share the name(s) {clash}; give the output axis another "
                "name (e.g. Axis('embed_out', n)) and rename it back after the call if needed"
            )
        fan_in = math.prod(a.size for a in In)
        std = init_scale / math.sqrt(fan_in) if scale_by_fan_in else init_scale
        shape = tuple(a.size for a in (*Out, *In))
        weight = NamedArray((jax.random.normal(key, shape, jnp.float32) * std).astype(dtype), (*Out, *In))
        bias = NamedArray(jnp.zeros(tuple(a.size for a in Out), dtype), Out) if use_bias else None
        return Linear(weight, bias, In, Out)

    def __call__(self, x: NamedArray) -> NamedArray:
        """Contract x's In axes with the weight; x's other axes come first, then the Out axes."""
        require_axes(x, self.In, "Linear")
        clash = [a.name for a in self.Out if x.has_axis(a.name)]
        if clash:
            raise ValueError(
                f"Linear input already has output axis name(s) {clash} (input axes {x.axis_names}); "
                "rename them in the input first"
            )
        require_same_dtype(x, self.weight, "Linear")
        plain = self.quant is None
        y = dot(x, self.weight, axis=self.In) if plain else self.quant(x, self.weight, self.In, self.Out)
        if self.bias is not None:
            y = y + self.bias
        return y
