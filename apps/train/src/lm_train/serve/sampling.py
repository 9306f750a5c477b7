"""Per-row sampling on the device: presence and frequency penalties, temperature, top-k, top-p and each row's own key;
the work that no row of a batch needs is skipped at run time, in the same compiled program."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

# Rows' fields: host arrays as the engine builds them, device arrays inside the compiled programs.
Arr = jax.Array | np.ndarray


class SamplingRows(Protocol):
    """Each row's sampling settings, (R,) arrays: the prefill rows and the decode state both have them."""

    @property
    def temperature(self) -> Arr: ...  # float32, 0: greedy
    @property
    def top_k(self) -> Arr: ...  # int32, 0: off
    @property
    def top_p(self) -> Arr: ...  # float32
    @property
    def presence(self) -> Arr: ...  # float32
    @property
    def frequency(self) -> Arr: ...  # float32
    @property
    def seed(self) -> Arr: ...  # uint32
    @property
    def choice(self) -> Arr: ...  # int32: which of the request's n choices the row is


def uses_penalties(rows: SamplingRows, active: Arr) -> jax.Array:
    """Whether any active row has a presence or frequency penalty (a scalar bool)."""
    return jnp.any(((rows.presence != 0) | (rows.frequency != 0)) & active)


def penalized(logits: jax.Array, counts: jax.Array, rows: SamplingRows) -> jax.Array:
    """Logits (R, V) less each row's frequency and presence penalties over its counts (R, V)."""
    seen = counts.astype(jnp.float32)
    return logits - rows.frequency[:, None] * seen - rows.presence[:, None] * (seen > 0).astype(jnp.float32)


def sample_rows(logits: jax.Array, rows: SamplingRows, index: Arr) -> jax.Array:
    """One token per row of (penalized) logits (R, V) under that row's temperature, top-k, top-p and the key of
    (seed, choice, index); rows of temperature 0 take the most likely token."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(rows.temperature, 1e-6)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = logits.shape[-1]
    # top-k: keep scores at least the k-th largest (ties kept); k = 0 keeps the whole vocabulary.
    k = jnp.where(rows.top_k > 0, rows.top_k, vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    # top-p: keep a token while the mass of the tokens strictly more likely than it is below p.
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    threshold = jnp.min(jnp.where(before < rows.top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)

    def draw(seed, choice, index, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), choice), index)
        return jax.random.categorical(key, row)

    sampled = jax.vmap(draw)(rows.seed, rows.choice, index, scaled).astype(jnp.int32)
    return jnp.where(rows.temperature > 0, sampled, greedy)


class Needs(NamedTuple):
    """What a batch's active rows need of the sampler (scalar bools, computed once per call): work that no row
    needs is skipped at run time, in the same compiled program."""

    penalties: jax.Array  # some row has a presence or frequency penalty
    draw: jax.Array  # some row samples (temperature > 0)


def needs_of(rows: SamplingRows, active: Arr) -> Needs:
    """What the active rows (R,) need of the sampler."""
    return Needs(uses_penalties(rows, active), jnp.any((rows.temperature > 0) & active))


def choose(
    logits: jax.Array, counts: Callable[[], jax.Array], rows: SamplingRows, index: Arr, needs: Needs
) -> jax.Array:
    """The token of each row (R,) from its logits (R, V) and penalty counts (R, V; read only when some row has a
    penalty). A row without penalties, or of temperature 0, gets the same token whether or not the batch's other
    rows make the sampler do that work, so its tokens do not depend on what shares its batch."""
    logits = jax.lax.cond(needs.penalties, lambda: penalized(logits, counts(), rows), lambda: logits)
    return jax.lax.cond(
        needs.draw,
        lambda: sample_rows(logits, rows, index),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
    )


def count_tokens(counts: jax.Array, slots: Arr, tokens: jax.Array, emit: Arr, needs: Needs) -> jax.Array:
    """The penalty counts (S, V) with each emitting row's token added at its slot; unchanged when no row has a
    penalty (a row without one never reads its counts, and a row with one starts from zero)."""
    return jax.lax.cond(
        needs.penalties, lambda: counts.at[slots, tokens].add(emit.astype(counts.dtype)), lambda: counts
    )


def token_logprobs(logits: jax.Array, tokens: Arr) -> tuple[jax.Array, jax.Array]:
    """log p(token) per row of logits (R, V) (before penalties and temperature), and each row's log-normalizer."""
    normalizer = jax.nn.logsumexp(logits, axis=-1)
    return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - normalizer, normalizer
