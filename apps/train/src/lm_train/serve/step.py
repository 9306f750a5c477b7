"""The engine's two compiled programs: a prefill step (a chunk of tokens per row through the paged cache, then a
token sampled per row with that row's own parameters and key) and a decode loop (up to k tokens per row in one call,
sampled and checked for stop tokens on the device), with the log-probabilities asked for."""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import paged_forward

from .params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

# Stop ids per row on the device: a request's own and the end-of-text token.
STOP_IDS = MAX_STOP_TOKEN_IDS + 1


class StepRows(NamedTuple):
    """One step's rows (R rows of C tokens); every field is an array with R leading, so shapes fix the program."""

    ids: jax.Array  # (R, C) int32: the tokens fed (padding where not valid)
    positions: jax.Array  # (R, C) int32: each token's position in its sequence
    valid: jax.Array  # (R, C) bool
    page_table: jax.Array  # (R, P) int32: each row's pages, NULL_PAGE where unused
    targets: jax.Array  # (R, C) int32: the token after each fed token, for prompt log-probs
    last: jax.Array  # (R,) int32: the index in the chunk whose logits choose the next token
    slot: jax.Array  # (R,) int32: the row's entry in the penalty counts (the last entry takes padding rows)
    reset: jax.Array  # (R,) bool: a new sequence: zero its counts first
    emit: jax.Array  # (R,) bool: the sampled token is generated (it counts towards the penalties)
    temperature: jax.Array  # (R,) float32
    top_k: jax.Array  # (R,) int32, 0: off
    top_p: jax.Array  # (R,) float32
    presence: jax.Array  # (R,) float32
    frequency: jax.Array  # (R,) float32
    seed: jax.Array  # (R,) uint32
    choice: jax.Array  # (R,) int32: which of the request's n choices the row is
    index: jax.Array  # (R,) int32: which generated token of its choice the row samples


class StepOut(NamedTuple):
    """What a step gives back per row."""

    token: jax.Array  # (R,) int32
    logprob: jax.Array  # (R,) float32: log p(token) under the model (before temperature and penalties)
    top_ids: jax.Array  # (R, K) int32: the K most likely tokens, K = min(MAX_LOGPROBS, vocabulary size)
    top_logprobs: jax.Array  # (R, K) float32
    target_logprob: jax.Array  # (R, C) float32: log p(targets) at each fed position
    target_top_ids: jax.Array  # (R, C, K) int32
    target_top_logprobs: jax.Array  # (R, C, K) float32


class DecodeRows(NamedTuple):
    """One decode call's rows (R rows, one per decode slot): each feeds its last token and then its own samples."""

    token: jax.Array  # (R,) int32: the last token, fed first
    position: jax.Array  # (R,) int32: its position in the sequence
    page_table: jax.Array  # (R, P) int32: the row's pages, grown to hold every token it may feed in this call
    budget: jax.Array  # (R,) int32: tokens the row may sample in this call (0: a padding row)
    stop_ids: jax.Array  # (R, STOP_IDS) int32: tokens that end the row (-1: none)
    slot: jax.Array  # (R,) int32: the row's entry in the penalty counts
    temperature: jax.Array  # (R,) float32
    top_k: jax.Array  # (R,) int32
    top_p: jax.Array  # (R,) float32
    presence: jax.Array  # (R,) float32
    frequency: jax.Array  # (R,) float32
    seed: jax.Array  # (R,) uint32
    choice: jax.Array  # (R,) int32
    index: jax.Array  # (R,) int32: which generated token of its choice the row samples first
    steps: jax.Array  # () int32: decode steps of this call, at most the loop's k
    want_top: jax.Array  # () bool: whether any row asked for alternatives (their top-k is computed only then)


class DecodeOut(NamedTuple):
    """What a decode call gives back: up to k tokens per row, in order (the first `produced` of each row count)."""

    tokens: jax.Array  # (k, R) int32
    logprob: jax.Array  # (k, R) float32
    top_ids: jax.Array  # (k, R, K) int32 (zeros unless want_top)
    top_logprobs: jax.Array  # (k, R, K) float32
    produced: jax.Array  # (R,) int32


def penalized(logits: jax.Array, counts: jax.Array, rows: StepRows | DecodeRows) -> jax.Array:
    """Logits (R, V) less each row's frequency and presence penalties over its counts."""
    seen = counts.astype(jnp.float32)
    return logits - rows.frequency[:, None] * seen - rows.presence[:, None] * (seen > 0).astype(jnp.float32)


def greedy_rows(logits: jax.Array, counts: jax.Array, rows: StepRows | DecodeRows) -> jax.Array:
    """The most likely token per row after penalties: what sample_rows gives a row of temperature 0."""
    return jnp.argmax(penalized(logits, counts, rows), axis=-1).astype(jnp.int32)


def sample_rows(logits: jax.Array, counts: jax.Array, rows: StepRows | DecodeRows) -> jax.Array:
    """One token per row of logits (R, V) under that row's penalties, temperature, top-k, top-p and key."""
    logits = penalized(logits, counts, rows)
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

    sampled = jax.vmap(draw)(rows.seed, rows.choice, rows.index, scaled).astype(jnp.int32)
    return jnp.where(rows.temperature > 0, sampled, greedy)


class EngineStep:
    """The compiled prefill step and decode loop, with a count of their compilations (one per shape of rows)."""

    def __init__(self, decode_steps: int = 8) -> None:
        self.compilations = 0
        self.decode_steps = decode_steps
        self._jitted = eqx.filter_jit(self._step, donate="all-except-first")
        self._decode_jitted = eqx.filter_jit(self._decode, donate="all-except-first")

    def decode(self, model: Any, cache: Any, counts: jax.Array, rows: DecodeRows) -> tuple[Any, jax.Array, DecodeOut]:
        """(the cache with every fed token written, the updated penalty counts, the tokens sampled)."""
        return self._decode_jitted(model, cache, counts, rows)

    def __call__(self, model: Any, cache: Any, counts: jax.Array, rows: StepRows) -> tuple[Any, jax.Array, StepOut]:
        """(the cache with the rows' tokens written, the updated penalty counts, the rows' outputs)."""
        return self._jitted(model, cache, counts, rows)

    def _step(self, model: Any, cache: Any, counts: jax.Array, rows: StepRows):
        self.compilations += 1  # runs only while tracing
        named = lambda x, axes: nt.named(x, axes)  # noqa: E731
        logits, cache = paged_forward(
            model,
            cache,
            named(rows.ids, ("batch", "position")),
            named(rows.positions, ("batch", "position")),
            named(rows.valid, ("batch", "position")),
            named(rows.page_table, ("batch", "page_index")),
        )
        logits = nt.permute(logits, ("batch", "position", model.Vocab.name)).array.astype(jnp.float32)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        target_logprob = jnp.take_along_axis(logprobs, rows.targets[..., None], axis=-1)[..., 0]
        alternatives = min(MAX_LOGPROBS, logits.shape[-1])
        target_top_logprobs, target_top_ids = jax.lax.top_k(logprobs, alternatives)

        last = jnp.take_along_axis(logits, rows.last[:, None, None], axis=1)[:, 0]
        last_logprobs = jax.nn.log_softmax(last, axis=-1)
        counts = counts.at[rows.slot].set(jnp.where(rows.reset[:, None], 0, counts[rows.slot]))
        token = sample_rows(last, counts[rows.slot], rows)
        counts = counts.at[rows.slot, token].add(rows.emit.astype(counts.dtype))
        top_logprobs, top_ids = jax.lax.top_k(last_logprobs, alternatives)
        logprob = jnp.take_along_axis(last_logprobs, token[:, None], axis=-1)[:, 0]
        out = StepOut(
            token, logprob, top_ids.astype(jnp.int32), top_logprobs, target_logprob,
            target_top_ids.astype(jnp.int32), target_top_logprobs,
        )  # fmt: skip
        return cache, counts, out

    def _decode(self, model: Any, cache: Any, counts: jax.Array, rows: DecodeRows):
        self.compilations += 1  # runs only while tracing
        k, R = self.decode_steps, rows.token.shape[0]
        alternatives = min(MAX_LOGPROBS, model.Vocab.size)
        table = nt.named(rows.page_table, ("batch", "page_index"))
        outs = DecodeOut(
            jnp.zeros((k, R), jnp.int32), jnp.zeros((k, R), jnp.float32),
            jnp.zeros((k, R, alternatives), jnp.int32), jnp.zeros((k, R, alternatives), jnp.float32),
            jnp.zeros((R,), jnp.int32),
        )  # fmt: skip

        def one_token(carry):
            i, cache, counts, token, active, outs = carry
            logits, cache = paged_forward(
                model,
                cache,
                nt.named(token[:, None], ("batch", "position")),
                nt.named((rows.position + i)[:, None], ("batch", "position")),
                nt.named(active[:, None], ("batch", "position")),
                table,
            )
            logits = nt.permute(logits, ("batch", "position", model.Vocab.name)).array[:, 0].astype(jnp.float32)
            logprobs = jax.nn.log_softmax(logits, axis=-1)
            seen = counts[rows.slot]
            # Greedy rows need no sort nor draw: skip them when every row is greedy (batch-1 decoding, mostly).
            new = jax.lax.cond(
                jnp.any(rows.temperature > 0),
                lambda: sample_rows(logits, seen, rows._replace(index=rows.index + i)),
                lambda: greedy_rows(logits, seen, rows),
            )
            counts = counts.at[rows.slot, new].add(active.astype(counts.dtype))
            top_logprobs, top_ids = jax.lax.cond(
                rows.want_top,
                lambda: tuple(jax.lax.top_k(logprobs, alternatives)),
                lambda: (jnp.zeros((R, alternatives), jnp.float32), jnp.zeros((R, alternatives), jnp.int32)),
            )
            logprob = jnp.take_along_axis(logprobs, new[:, None], axis=-1)[:, 0]
            produced = outs.produced + active.astype(jnp.int32)
            outs = DecodeOut(
                outs.tokens.at[i].set(new), outs.logprob.at[i].set(logprob),
                outs.top_ids.at[i].set(top_ids.astype(jnp.int32)), outs.top_logprobs.at[i].set(top_logprobs),
                produced,
            )  # fmt: skip
            # A row stops at a stop token or its budget; the host still cuts it at stop strings.
            stopped = jnp.any(new[:, None] == rows.stop_ids, axis=-1)
            active = active & ~stopped & (produced < rows.budget)
            return i + 1, cache, counts, new, active, outs

        def going(carry):
            i, *_, active, _ = carry
            return (i < jnp.minimum(rows.steps, k)) & jnp.any(active)

        start = (jnp.int32(0), cache, counts, rows.token, rows.budget > 0, outs)
        _, cache, counts, _, _, outs = jax.lax.while_loop(going, one_token, start)
        return cache, counts, outs
