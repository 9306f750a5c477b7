"""Feed-forward blocks: a plain two-layer MLP and a gated (SwiGLU-style) MLP, built from Linear."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._core import Axis, NamedArray
from .activations import activation_fn
from .linear import Linear


class MLP(eqx.Module):
    """down(act(up(x))): In -> Hidden -> Out.

    Layouts: `up.weight` (Hidden, *In), `down.weight` (*Out, Hidden); biases over Hidden and Out.
    """

    up: Linear
    down: Linear
    activation: str = eqx.field(static=True)

    @staticmethod
    def init(
        In: Axis | Sequence[Axis],
        Hidden: Axis,
        Out: Axis | Sequence[Axis],
        *,
        key: jax.Array,
        activation: str = "gelu_new",
        use_bias: bool = True,
        init_scale: float = 1.0,
        dtype: DTypeLike = jnp.float32,
    ) -> MLP:
        """Two Linear layers with independent keys; see Linear.init for the weight distribution."""
        activation_fn(activation)  # fail at build time, not at the first call
        k_up, k_down = jax.random.split(key)
        up = Linear.init(In, Hidden, key=k_up, use_bias=use_bias, init_scale=init_scale, dtype=dtype)
        down = Linear.init(Hidden, Out, key=k_down, use_bias=use_bias, init_scale=init_scale, dtype=dtype)
        return MLP(up, down, activation)

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the block; x's axes other than In are kept."""
        return self.down(activation_fn(self.activation)(self.up(x)))


class GatedMLP(eqx.Module):
    """down(act(gate(x)) * up(x)), the Llama feed-forward (SwiGLU with activation "silu").

    Layouts: `gate.weight` and `up.weight` (Hidden, *In), `down.weight` (*Out, Hidden).
    """

    gate: Linear
    up: Linear
    down: Linear
    activation: str = eqx.field(static=True)

    @staticmethod
    def init(
        In: Axis | Sequence[Axis],
        Hidden: Axis,
        Out: Axis | Sequence[Axis],
        *,
        key: jax.Array,
        activation: str = "silu",
        use_bias: bool = False,
        init_scale: float = 1.0,
        dtype: DTypeLike = jnp.float32,
    ) -> GatedMLP:
        """Three Linear layers with independent keys; see Linear.init for the weight distribution."""
        activation_fn(activation)
        k_gate, k_up, k_down = jax.random.split(key, 3)
        kw: dict[str, Any] = {"use_bias": use_bias, "init_scale": init_scale, "dtype": dtype}
        return GatedMLP(
            Linear.init(In, Hidden, key=k_gate, **kw),
            Linear.init(In, Hidden, key=k_up, **kw),
            Linear.init(Hidden, Out, key=k_down, **kw),
            activation,
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        """Apply the block; x's axes other than In are kept."""
        return self.down(activation_fn(self.activation)(self.gate(x)) * self.up(x))
