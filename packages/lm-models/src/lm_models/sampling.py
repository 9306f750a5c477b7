"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import AxisSelector, NamedArray


def top_k_filter(logits: NamedArray, Vocab: AxisSelector, k: int) -> NamedArray:
    """Logits with every entry below the k-th largest along Vocab set to -inf (ties at the k-th are kept)."""
    size = logits.axis_size(Vocab)
    if not 1 <= k <= size:
        raise ValueError(f"top_k={k} must be between 1 and the vocabulary size {size}")
    values, _ = nt.top_k(logits, Vocab, k, new_axis="top_k")
    threshold = nt.min(values, "top_k")
    return nt.where(logits < threshold, -jnp.inf, logits)


def top_p_filter(logits: NamedArray, Vocab: AxisSelector, p: float) -> NamedArray:
    """Logits kept only for the smallest set of most likely tokens whose probability reaches p; others -inf."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p={p} must be in (0, 1]")
    ordered = nt.sort(logits, Vocab, descending=True)
    probs = nt.softmax(ordered, Vocab)
    # A token is kept when the mass of the tokens strictly more likely than it is still below p, so the
    # most likely token is always kept.
    mass_before = nt.cumsum(probs, Vocab) - probs
    kept_values = nt.where(mass_before < p, ordered, jnp.inf)
    threshold = nt.min(kept_values, Vocab)
    return nt.where(logits < threshold, -jnp.inf, logits)


def sample_next_token(
    logits: NamedArray,
    Vocab: AxisSelector,
    *,
    key: jax.Array | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> NamedArray:
    """Token ids drawn from logits over Vocab (argmax when temperature is 0); logits' other axes are kept."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if temperature == 0:
        return nt.argmax(logits, Vocab).astype(jnp.int32)
    if key is None:
        raise ValueError("Sampling with temperature > 0 needs a PRNG key: pass key=jax.random.key(...)")
    logits = logits.astype(jnp.float32) / jnp.float32(temperature)
    if top_k is not None:
        logits = top_k_filter(logits, Vocab, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, Vocab, top_p)
    return nt.random.categorical(key, logits, Vocab).astype(jnp.int32)
