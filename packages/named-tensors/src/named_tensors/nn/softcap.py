"""Soft-capping: cap * tanh(x / cap), a smooth bound on attention scores or logits (Gemma 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._core import NamedArray


def soft_cap(x: NamedArray, cap: float | None) -> NamedArray:
    """x squashed into (-cap, cap) by cap * tanh(x / cap); x itself when cap is None."""
    if cap is None:
        return x
    if not isinstance(x, NamedArray):
        raise TypeError(f"soft_cap takes a NamedArray, got {type(x).__name__}")
    return NamedArray(soft_cap_array(x.array, cap), x.axes)


def soft_cap_array(x: jax.Array, cap: float) -> jax.Array:
    """soft_cap on a plain array (for code that works below NamedArrays, such as blockwise attention)."""
    if not cap > 0:
        raise ValueError(f"A soft cap must be positive (or None for no cap), got {cap!r}")
    c = jnp.asarray(cap, x.dtype)
    return jnp.tanh(x / c) * c
