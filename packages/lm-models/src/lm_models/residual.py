"""The parts GPT-2's and MPT's pre-norm blocks share: the two-matrix MLP and the residual adds with dropout."""

from __future__ import annotations

from collections.abc import Callable

import jax

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import MLP, Linear

from .model import dropout


def two_matrix_mlp(
    Embed: Axis,
    Mlp: Axis,
    activation: str,
    *,
    keys: tuple[jax.Array, jax.Array],
    use_bias: bool,
    init_std: float,
    output_init_std: float,
) -> MLP:
    """An embed -> mlp -> embed MLP whose weights are ~ Normal(0, std), not scaled by fan-in."""
    k_up, k_down = keys
    return MLP(
        Linear.init(Embed, Mlp, key=k_up, use_bias=use_bias, init_scale=init_std, scale_by_fan_in=False),
        Linear.init(Mlp, Embed, key=k_down, use_bias=use_bias, init_scale=output_init_std, scale_by_fan_in=False),
        activation,
    )


def add_attention_and_mlp(
    x: NamedArray,
    attn_out: NamedArray,
    norm: Callable[[NamedArray], NamedArray],
    mlp: Callable[[NamedArray], NamedArray],
    rate: float,
    keys: tuple[jax.Array | None, jax.Array | None],
    inference: bool,
) -> NamedArray:
    """x + dropout(attn_out), then + dropout(mlp(norm(that))); sharded as the residual stream."""
    k_drop_attn, k_drop_mlp = keys
    x = x + dropout(attn_out, rate, k_drop_attn, inference)
    x = x + dropout(mlp(norm(x)), rate, k_drop_mlp, inference)
    return nt.shard(x)
