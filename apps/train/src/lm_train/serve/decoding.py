"""The decode rows: their state kept on the device between decode calls, the host's book of which sequence each row
serves, the patch of what changed since the last call, and a one-call pipeline (the next call is dispatched before
the last one's tokens are read)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from lm_models.paged_cache import NULL_PAGE

from .outputs import accept_call, send_delta
from .pages import PagePool
from .requests import Sequence
from .rows import grow
from .step import KEEP, STOP_IDS, TABLE, WHOLE, DecodeOut, DecodeState, EngineStep, RowPatch


def empty_state(rows: int, pages_per_seq: int) -> DecodeState:
    """Host arrays of `rows` idle decode rows (nothing to sample, every page the null page)."""
    i32, f32 = np.int32, np.float32
    return DecodeState(
        token=np.zeros(rows, i32), position=np.zeros(rows, i32), remaining=np.zeros(rows, i32),
        index=np.zeros(rows, i32), page_table=np.full((rows, pages_per_seq), NULL_PAGE, i32),
        stop_ids=np.full((rows, STOP_IDS), -1, i32), want_top=np.zeros(rows, bool), temperature=np.zeros(rows, f32),
        top_k=np.zeros(rows, i32), top_p=np.ones(rows, f32), presence=np.zeros(rows, f32),
        frequency=np.zeros(rows, f32), seed=np.zeros(rows, np.uint32), choice=np.zeros(rows, i32),
    )  # fmt: skip


class Decoder:
    """Row r of the decode state serves the sequence in slot r. The device keeps each row's last token, position,
    budget, pages and sampling settings from one call to the next; the host sends a patch only for the rows that
    changed (a sequence joined or left, pages grown), and none at all in a steady decode. A call is dispatched
    before the previous call's tokens are read, so that the host's work overlaps the device's; what a row samples
    after its sequence finished on the host (a stop string) is dropped, as the tokens after a stop always were."""

    def __init__(self, step_fn: EngineStep, rows: int, pages_per_seq: int, eos_token_id: int | None) -> None:
        self.step_fn = step_fn
        self.rows, self.pages_per_seq, self.eos_token_id = rows, pages_per_seq, eos_token_id
        self.owners: list[Sequence | None] = [None] * rows
        self.state: DecodeState = jax.device_put(empty_state(rows, pages_per_seq))
        self._values = empty_state(rows, pages_per_seq)
        self._mode = np.full(rows, KEEP, np.int32)
        self._keep: dict[int, RowPatch] = {}  # a patch that changes nothing, per number of steps, on the device
        # The call in flight: its outputs and the sequence each row served when it was dispatched.
        self._pending: tuple[DecodeOut, list[Sequence | None]] | None = None

    @property
    def active(self) -> bool:
        """Whether a row serves a sequence or a call's tokens are still to be read."""
        return self._pending is not None or any(seq is not None for seq in self.owners)

    def join(self, seq: Sequence) -> None:
        """Seq (its prompt read, its first token sampled) decodes in the row of its slot from the next call on."""
        r, p, v = seq.slot, seq.request.params, self._values
        self._clear(r)
        v.token[r], v.position[r], v.index[r] = seq.tokens[-1], len(seq.tokens) - 1, len(seq.generated)
        v.remaining[r] = p.max_tokens - len(seq.generated)
        stops = [*p.stop_token_ids, *([] if self.eos_token_id is None or p.ignore_eos else [self.eos_token_id])]
        v.stop_ids[r, : len(stops)] = stops
        v.page_table[r, : len(seq.pages)] = seq.pages
        v.want_top[r] = bool(p.logprobs)
        v.temperature[r], v.top_k[r], v.top_p[r] = p.temperature, p.top_k, p.top_p
        v.presence[r], v.frequency[r] = p.presence_penalty, p.frequency_penalty
        v.seed[r], v.choice[r] = seq.request.seed, seq.choice
        seq.bound = len(seq.generated)
        self.owners[r] = seq

    def leave(self, seq: Sequence) -> None:
        """Seq finished on the host: its row samples nothing from the next call on (its pages may serve others)."""
        if 0 <= seq.slot < self.rows and self.owners[seq.slot] is seq:
            self.owners[seq.slot] = None
            self._clear(seq.slot)

    def reset(self) -> None:
        """Every row idle and no call in flight (after a failed step, whose state may have been consumed)."""
        self.owners = [None] * self.rows
        self._pending = None
        self.state = jax.device_put(empty_state(self.rows, self.pages_per_seq))
        self._values, self._mode = empty_state(self.rows, self.pages_per_seq), np.full(self.rows, KEEP, np.int32)

    def advance(
        self,
        model: Any,
        cache: Any,
        counts: jax.Array,
        steps: int,
        pool: PagePool,
        decode: Callable[[list[int]], str],
        release: Callable[[Sequence], None],
    ) -> tuple[Any, jax.Array, list[tuple[Sequence, str]]]:
        """Dispatch a call of up to `steps` tokens per row (unless no row may sample more), then read the previous
        call's tokens into their sequences: (the cache, the counts, the sequences that finished and why). A
        sequence whose last token is in the call dispatched is `release`d at once (its pages and slot)."""
        previous, self._pending = self._pending, None
        budgets = self._budgets(steps, pool)
        if any(budgets):
            cache, counts, self.state, out = self.step_fn.decode(model, cache, counts, self.state, self._patch(steps))
            self._pending = (out, list(self.owners))
            # Whatever a later call or prefill writes into these pages runs after this call on the device (each
            # takes the cache this one gives back), so they may serve another sequence from the next step on.
            for seq in list(self.owners):
                if seq is not None and seq.bound >= seq.request.params.max_tokens:
                    release(seq)
        return cache, counts, self._read(previous, decode)

    def _budgets(self, steps: int, pool: PagePool) -> list[int]:
        """Tokens each row may sample in the next call, its pages grown to hold what it feeds (patched when grown)."""
        budgets = []
        for r, seq in enumerate(self.owners):
            budget = 0 if seq is None else min(steps, seq.request.params.max_tokens - seq.bound)
            if seq is not None and budget > 0:
                # The call feeds positions up to prompt + bound + budget - 2 (the last token sampled is not fed).
                had = len(seq.pages)
                grow(seq, len(seq.prompt) + seq.bound + budget - 2, pool)
                if len(seq.pages) > had:
                    self._values.page_table[r, : len(seq.pages)] = seq.pages
                    self._mode[r] = max(self._mode[r], TABLE)
                seq.bound += budget
            budgets.append(max(budget, 0))
        return budgets

    def _patch(self, steps: int) -> RowPatch:
        """What changed since the last call: host arrays sent with the call, or the kept no-op patch (no transfer)."""
        if not self._mode.any():
            if steps not in self._keep:
                idle = RowPatch(np.full(self.rows, KEEP, np.int32), empty_state(self.rows, self.pages_per_seq),
                                np.asarray(steps, np.int32))  # fmt: skip
                self._keep[steps] = jax.device_put(idle)
            return self._keep[steps]
        patch = RowPatch(self._mode, self._values, np.asarray(steps, np.int32))
        # Fresh arrays for the next patch: the ones just sent may still be read by the call in flight.
        self._values = empty_state(self.rows, self.pages_per_seq)
        self._mode = np.full(self.rows, KEEP, np.int32)
        return patch

    def _clear(self, r: int) -> None:
        """Patch row r whole to an idle row (a sequence then fills it, or none)."""
        for field, empty in zip(self._values, empty_state(1, self.pages_per_seq), strict=True):
            field[r] = empty[0]
        self._mode[r] = WHOLE

    def _read(
        self, call: tuple[DecodeOut, list[Sequence | None]] | None, decode: Callable[[list[int]], str]
    ) -> list[tuple[Sequence, str]]:
        """A call's tokens, accepted in order by the sequences that its rows served and that still run."""
        if call is None:
            return []
        out, owners = call
        live = [(r, seq) for r, seq in enumerate(owners) if seq is not None and seq.finish_reason is None]
        tokens, logprob, produced = np.asarray(out.tokens), np.asarray(out.logprob), np.asarray(out.produced)
        # The alternatives cross back only when some request asked for them.
        wants_top = any(seq.request.params.logprobs for _, seq in live)
        top_ids, top_lp = (np.asarray(out.top_ids), np.asarray(out.top_logprobs)) if wants_top else (None, None)
        finished = []
        for r, seq in live:
            top = (top_ids[:, r], top_lp[:, r]) if top_ids is not None and top_lp is not None else None
            reason = accept_call(seq, tokens[:, r], logprob[:, r], top, int(produced[r]), self.eos_token_id, decode)
            if reason is not None:
                finished.append((seq, reason))
            elif seq.request.on_delta is not None:
                send_delta(seq, None)
        return finished
