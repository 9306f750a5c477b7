"""ALiBi attention bias with MPT's slopes (as Hugging Face's MPT builds them), over named axes."""

from __future__ import annotations

import math

import jax.numpy as jnp

from .._core import Axis, NamedArray, axis_name


def alibi_slopes(Heads: Axis, *, max_bias: float = 8.0) -> NamedArray:
    """float32 slope per head: 2^(-max_bias * i / n) for n the next power of two above the head count,
    and for a head count that is not a power of two, the odd-indexed slopes first, then the even ones."""
    if not isinstance(Heads, Axis) or Heads.size < 1:
        raise ValueError(f"alibi_slopes needs an Axis with at least one head, got {Heads!r}")
    padded = 2 ** math.ceil(math.log2(Heads.size))
    exponents = jnp.arange(1, padded + 1, dtype=jnp.float32) * (max_bias / padded)
    slopes = 1.0 / (2.0**exponents)
    if padded != Heads.size:
        slopes = jnp.concatenate([slopes[1::2], slopes[::2]])[: Heads.size]
    return NamedArray(slopes, (Heads,))


def alibi_bias(
    Heads: Axis, KPos: Axis, *, QPos: Axis | None = None, max_bias: float = 8.0, dtype=jnp.float32
) -> NamedArray:
    """ALiBi bias to add to attention scores.

    Without QPos: (Heads, KPos) holding slope * (k - (KPos.size - 1)), MPT's causal form (it relies on
    softmax being unchanged by a per-row constant, so it equals -slope * (q - k) under a causal mask).
    With QPos: (Heads, QPos, KPos) holding -slope * |q - k|, the symmetric form for non-causal attention.
    """
    if not isinstance(KPos, Axis):
        raise TypeError(f"alibi_bias needs the key position Axis with its size, got {KPos!r}")
    slopes = alibi_slopes(Heads, max_bias=max_bias)
    k = jnp.arange(KPos.size, dtype=jnp.float32)
    if QPos is None:
        distance = NamedArray(k - (KPos.size - 1), (KPos,))
    else:
        if axis_name(QPos) == KPos.name:
            raise ValueError(f"alibi_bias: QPos and KPos need different names, both are {KPos.name!r}")
        q = jnp.arange(QPos.size, dtype=jnp.float32)
        distance = NamedArray(-jnp.abs(q[:, None] - k[None, :]), (QPos, KPos))
    return (slopes * distance).astype(dtype)
