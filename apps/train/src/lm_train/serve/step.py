"""The engine's two compiled programs: a prefill step (a chunk of tokens per row through the paged cache, then a
token sampled per row with that row's own parameters and key) and a decode loop (up to k tokens per row in one call,
from the rows' state kept on the device, sampled and checked for stop tokens there), with the log-probabilities
asked for."""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import paged_forward

from .params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from .sampling import Arr, choose, count_tokens, needs_of, token_logprobs

# Stop ids per row on the device: a request's own and the end-of-text token.
STOP_IDS = MAX_STOP_TOKEN_IDS + 1


class StepRows(NamedTuple):
    """One step's rows (R rows of C tokens); every field is an array with R leading (but the two flags), so shapes
    fix the program."""

    ids: Arr  # (R, C) int32: the tokens fed (padding where not valid)
    positions: Arr  # (R, C) int32: each token's position in its sequence
    valid: Arr  # (R, C) bool
    page_table: Arr  # (R, P) int32: each row's pages, NULL_PAGE where unused
    targets: Arr  # (R, C) int32: the token after each fed token, for prompt log-probs
    last: Arr  # (R,) int32: the index in the chunk whose logits choose the next token
    slot: Arr  # (R,) int32: the row's entry in the penalty counts (the last entry takes padding rows)
    reset: Arr  # (R,) bool: a new sequence: zero its counts first
    emit: Arr  # (R,) bool: the sampled token is generated (it counts towards the penalties)
    temperature: Arr  # (R,) float32
    top_k: Arr  # (R,) int32, 0: off
    top_p: Arr  # (R,) float32
    presence: Arr  # (R,) float32
    frequency: Arr  # (R,) float32
    seed: Arr  # (R,) uint32
    choice: Arr  # (R,) int32: which of the request's n choices the row is
    index: Arr  # (R,) int32: which generated token of its choice the row samples
    want_top: Arr  # () bool: some row asked for the sampled token's alternatives
    want_prompt: Arr  # () bool: some row asked for its prompt's log-probs


class StepOut(NamedTuple):
    """What a step gives back per row (the alternatives and the prompt's scores are zeros unless asked for)."""

    token: jax.Array  # (R,) int32
    logprob: jax.Array  # (R,) float32: log p(token) under the model (before temperature and penalties)
    top_ids: jax.Array  # (R, K) int32: the K most likely tokens, K = min(MAX_LOGPROBS, vocabulary size)
    top_logprobs: jax.Array  # (R, K) float32
    target_logprob: jax.Array  # (R, C) float32: log p(targets) at each fed position
    target_top_ids: jax.Array  # (R, C, K) int32
    target_top_logprobs: jax.Array  # (R, C, K) float32


class DecodeState(NamedTuple):
    """Each decode row's state (R rows, one per decode slot), kept on the device from one decode call to the next:
    a call feeds each active row's last token and then its own samples, and leaves the row ready for the next."""

    token: Arr  # (R,) int32: the last token, fed first
    position: Arr  # (R,) int32: its position in the sequence
    remaining: Arr  # (R,) int32: tokens the row may still sample (0: an idle row)
    index: Arr  # (R,) int32: which generated token of its choice the row samples next
    page_table: Arr  # (R, P) int32: the row's pages, grown ahead of what it may feed
    stop_ids: Arr  # (R, STOP_IDS) int32: tokens that end the row (-1: none)
    want_top: Arr  # (R,) bool: the row's request asked for alternatives
    temperature: Arr  # (R,) float32
    top_k: Arr  # (R,) int32
    top_p: Arr  # (R,) float32
    presence: Arr  # (R,) float32
    frequency: Arr  # (R,) float32
    seed: Arr  # (R,) uint32
    choice: Arr  # (R,) int32


# How a row patch changes a row of the decode state.
KEEP, TABLE, WHOLE = 0, 1, 2


class RowPatch(NamedTuple):
    """What the host changed since the last decode call: per row, nothing (KEEP), its page table (TABLE: pages
    grown) or all of it (WHOLE: a sequence joined or left); and the call's number of decode steps."""

    mode: Arr  # (R,) int32
    values: DecodeState  # the new values of the rows patched (the others are not read)
    steps: Arr  # () int32: decode steps of this call, at most the loop's k


class DecodeOut(NamedTuple):
    """What a decode call gives back: up to k tokens per row, in order (the first `produced` of each row count)."""

    tokens: jax.Array  # (k, R) int32
    logprob: jax.Array  # (k, R) float32
    top_ids: jax.Array  # (k, R, K) int32 (zeros unless some row wants alternatives)
    top_logprobs: jax.Array  # (k, R, K) float32
    produced: jax.Array  # (R,) int32


def patched(state: DecodeState, patch: RowPatch) -> DecodeState:
    """The state with the patch's rows replaced: whole rows, or only their page tables."""
    whole, table = patch.mode == WHOLE, patch.mode != KEEP

    def pick(rows: Arr, new: Arr, old: Arr) -> jax.Array:
        return jnp.where(rows.reshape(rows.shape + (1,) * (old.ndim - 1)), new, old)

    fields = [pick(whole, new, old) for new, old in zip(patch.values, state, strict=True)]
    return DecodeState(*fields)._replace(page_table=pick(table, patch.values.page_table, state.page_table))


def _top(logits: jax.Array, normalizer: jax.Array, alternatives: int) -> tuple[jax.Array, jax.Array]:
    """The `alternatives` most likely tokens of each row of logits (..., V): their ids and log-probs."""
    top_logits, top_ids = jax.lax.top_k(logits, alternatives)
    return top_ids.astype(jnp.int32), top_logits - normalizer[..., None]


def _zeros_top(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)


class EngineStep:
    """The compiled prefill step and decode loop, with a count of their compilations (one per shape of rows)."""

    def __init__(self, decode_steps: int = 8) -> None:
        self.compilations = 0
        self.decode_steps = decode_steps
        # The first argument (the model and what the host sends) is read, never consumed: the decode loop's
        # patches are kept on the device and sent again. The cache, counts and state are updated in place.
        self._jitted = eqx.filter_jit(self._step, donate="all-except-first")
        self._decode_jitted = eqx.filter_jit(self._decode, donate="all-except-first")

    def __call__(self, model: Any, cache: Any, counts: jax.Array, rows: StepRows) -> tuple[Any, jax.Array, StepOut]:
        """(the cache with the rows' tokens written, the updated penalty counts, the rows' outputs)."""
        return self._jitted((model, rows), cache, counts)

    def decode(
        self, model: Any, cache: Any, counts: jax.Array, state: DecodeState, patch: RowPatch
    ) -> tuple[Any, jax.Array, DecodeState, DecodeOut]:
        """(the cache with every fed token written, the updated penalty counts, the rows' state after the call, the
        tokens sampled), from the state with the patch applied."""
        return self._decode_jitted((model, patch), cache, counts, state)

    def _step(self, inputs: tuple[Any, StepRows], cache: Any, counts: jax.Array):
        self.compilations += 1  # runs only while tracing
        model, rows = inputs
        logits, cache = paged_forward(
            model,
            cache,
            nt.named(rows.ids, ("batch", "position")),
            nt.named(rows.positions, ("batch", "position")),
            nt.named(rows.valid, ("batch", "position")),
            nt.named(rows.page_table, ("batch", "page_index")),
        )
        logits = nt.permute(logits, ("batch", "position", model.Vocab.name)).array.astype(jnp.float32)
        R, C = rows.ids.shape
        alternatives = min(MAX_LOGPROBS, logits.shape[-1])

        def prompt_scores():
            target, normalizer = token_logprobs(logits.reshape(R * C, -1), rows.targets.reshape(-1))
            top_ids, top_lp = _top(logits, normalizer.reshape(R, C), alternatives)
            return target.reshape(R, C), top_ids, top_lp

        def no_prompt_scores():
            return jnp.zeros((R, C), jnp.float32), *_zeros_top((R, C, alternatives))

        # The prompt's log-probs and alternatives: a log-softmax and a top-k over every position of the chunk, done
        # only when a request asks (an echo with logprobs).
        scores = jax.lax.cond(rows.want_prompt, prompt_scores, no_prompt_scores)

        last = jnp.take_along_axis(logits, rows.last[:, None, None], axis=1)[:, 0]
        needs = needs_of(rows, jnp.any(rows.valid, axis=-1))
        reset = lambda: counts.at[rows.slot].set(jnp.where(rows.reset[:, None], 0, counts[rows.slot]))  # noqa: E731
        counts = jax.lax.cond(needs.penalties, reset, lambda: counts)
        token = choose(last, lambda: counts[rows.slot], rows, rows.index, needs)
        counts = count_tokens(counts, rows.slot, token, rows.emit, needs)
        logprob, normalizer = token_logprobs(last, token)
        top = jax.lax.cond(
            rows.want_top, lambda: _top(last, normalizer, alternatives), lambda: _zeros_top((R, alternatives))
        )
        return cache, counts, StepOut(token, logprob, *top, *scores)

    def _decode(self, inputs: tuple[Any, RowPatch], cache: Any, counts: jax.Array, state: DecodeState):
        self.compilations += 1  # runs only while tracing
        model, patch = inputs
        state = patched(state, patch)
        k, R = self.decode_steps, state.token.shape[0]
        alternatives = min(MAX_LOGPROBS, model.Vocab.size)
        table = nt.named(state.page_table, ("batch", "page_index"))
        budget = jnp.minimum(jnp.minimum(patch.steps, k), state.remaining)
        # Decided once per call, from the rows that start it: rows only ever leave the loop.
        needs = needs_of(state, budget > 0)
        want_top = jnp.any(state.want_top & (budget > 0))
        rows = jnp.arange(R)
        outs = DecodeOut(
            jnp.zeros((k, R), jnp.int32), jnp.zeros((k, R), jnp.float32),
            *_zeros_top((k, R, alternatives)), jnp.zeros((R,), jnp.int32),
        )  # fmt: skip

        def one_token(carry):
            i, cache, counts, token, active, stopped, outs = carry
            logits, cache = paged_forward(
                model,
                cache,
                nt.named(token[:, None], ("batch", "position")),
                nt.named((state.position + i)[:, None], ("batch", "position")),
                nt.named(active[:, None], ("batch", "position")),
                table,
            )
            logits = nt.permute(logits, ("batch", "position", model.Vocab.name)).array[:, 0].astype(jnp.float32)
            new = choose(logits, lambda: counts[:R], state, state.index + i, needs)
            counts = count_tokens(counts, rows, new, active, needs)
            logprob, normalizer = token_logprobs(logits, new)
            top_ids, top_lp = jax.lax.cond(
                want_top, lambda: _top(logits, normalizer, alternatives), lambda: _zeros_top((R, alternatives))
            )
            produced = outs.produced + active.astype(jnp.int32)
            outs = DecodeOut(
                outs.tokens.at[i].set(new), outs.logprob.at[i].set(logprob),
                outs.top_ids.at[i].set(top_ids), outs.top_logprobs.at[i].set(top_lp), produced,
            )  # fmt: skip
            # A row stops at a stop token or its budget; the host still cuts it at stop strings.
            hit = active & jnp.any(new[:, None] == state.stop_ids, axis=-1)
            token = jnp.where(active, new, token)
            active = active & ~hit & (produced < budget)
            return i + 1, cache, counts, token, active, stopped | hit, outs

        def going(carry):
            i, *_, active, _, _ = carry
            return (i < k) & jnp.any(active)

        start = (jnp.int32(0), cache, counts, state.token, budget > 0, jnp.zeros((R,), bool), outs)
        _, cache, counts, token, _, stopped, outs = jax.lax.while_loop(going, one_token, start)
        # Ready for the next call: a row that met a stop token samples no more until the host patches it.
        state = state._replace(
            token=token,
            position=state.position + outs.produced,
            index=state.index + outs.produced,
            remaining=jnp.where(stopped, 0, state.remaining - outs.produced),
        )
        return cache, counts, state, outs
