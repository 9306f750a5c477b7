"""Dropout with an explicit PRNG key and an inference mode."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core import NamedArray


class Dropout(eqx.Module):
    """Zero each element with probability p and scale the rest by 1/(1-p); identity in inference mode."""

    p: float = eqx.field(static=True)
    inference: bool = eqx.field(static=True, default=False)

    def __check_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"Dropout probability must be in [0, 1], got {self.p}")

    def __call__(self, x: NamedArray, *, key: jax.Array | None = None, inference: bool | None = None) -> NamedArray:
        """Apply dropout; `inference` (here or on the layer) or p == 0 return x unchanged, with no key."""
        if not isinstance(x, NamedArray):
            raise TypeError(f"Dropout takes a NamedArray, got {type(x).__name__}")
        inference = self.inference if inference is None else inference
        if inference or self.p == 0.0:
            return x
        if key is None:
            raise ValueError(
                "Dropout in training mode needs a PRNG key: call it with key=..., or pass inference=True "
                "(or build it with Dropout(p, inference=True)) to turn it off"
            )
        if self.p == 1.0:
            return NamedArray(jnp.zeros_like(x.array), x.axes)
        keep = jax.random.bernoulli(key, 1.0 - self.p, x.array.shape)
        kept = x.array / jnp.asarray(1.0 - self.p, x.dtype)
        return NamedArray(jnp.where(keep, kept, jnp.zeros((), x.dtype)), x.axes)
