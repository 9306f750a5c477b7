"""The serving engine: continuous batching of requests over a paged KV cache, with chunked prefill and per-request
sampling. It takes a model (params in memory) and token ids, and knows no HTTP."""

from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm_models import inference_mode, init_paged_cache, supports_paging
from lm_models.paged_cache import NULL_PAGE

from .pages import PagePool
from .params import RequestError, SamplingParams
from .requests import ChoiceOutput, Delta, Request, Sequence, TokenLogprob
from .step import EngineStep, StepRows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's bounds: they fix the compiled shapes, so requests of any length reuse the same programs."""

    page_size: int = 16
    # Pages in the pool (page 0 is reserved); None: as many as memory_fraction of free device memory holds.
    num_pages: int | None = None
    memory_fraction: float = 0.25
    max_seqs: int = 16  # sequences decoded together
    prefill_rows: int = 4  # prompts whose chunks are computed together in one prefill step
    prefill_chunk: int = 64  # prompt tokens per row and prefill step
    max_waiting: int = 256  # requests queued beyond the running ones; more are refused (ServerFullError)

    def check(self) -> EngineConfig:
        for name in ("page_size", "max_seqs", "prefill_rows", "prefill_chunk", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        if self.num_pages is None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        return self


class ServerFullError(RuntimeError):
    """Too many requests are waiting: try again later."""


def bytes_per_page(config: Any, page_size: int, dtype: Any) -> int:
    """Device bytes of one page: keys and values of page_size positions in every layer."""
    return 2 * config.Layers.size * page_size * config.KVHeads.size * config.HeadSize.size * jnp.dtype(dtype).itemsize


def free_device_bytes() -> int:
    """Free memory of the first device (its allocator's figure; on CPU, the host's available memory)."""
    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Engine:
    """Serves prompts (token ids) from one model: submit() from any thread, and run() the engine's loop in its own
    thread with start(), or call step() / generate() in-process (RL)."""

    def __init__(
        self,
        model: Any,
        config: EngineConfig = EngineConfig(),
        *,
        eos_token_id: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ):
        if not supports_paging(model):
            raise ValueError(f"{type(model).__name__} cannot be served: it cannot decode through a paged cache")
        self.config = config.check()
        self.model = inference_mode(model)
        self.eos_token_id = eos_token_id
        self.decode = decode or (lambda ids: "")
        model_config = model.config
        self.max_positions = int(getattr(model_config, "max_positions", None) or model_config.seq_len)
        self.vocab_size = model.Vocab.size
        dtype = model.unembedding().dtype
        num_pages = config.num_pages
        if num_pages is None:
            num_pages = int(config.memory_fraction * free_device_bytes()) // bytes_per_page(
                model_config, config.page_size, dtype
            )
            num_pages = max(2, min(num_pages, 1 + config.max_seqs * -(-self.max_positions // config.page_size)))
        self.pool = PagePool(num_pages, config.page_size)
        self.pages_per_seq = -(-self.max_positions // config.page_size)
        self.cache = init_paged_cache(model_config, num_pages, config.page_size, dtype)
        # Penalty counts per decode slot; the last row takes padding rows' updates.
        self.counts = jnp.zeros((config.max_seqs + 1, self.vocab_size), jnp.int32)
        self.step_fn = EngineStep()
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._slots: list[Sequence | None] = [None] * config.max_seqs
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._count = 0
        self._lock = threading.Lock()

    # ---- submitting -------------------------------------------------------------------------------------------

    def submit(
        self,
        prompt: Seq[int],
        params: SamplingParams = SamplingParams(),
        *,
        on_delta: Callable[[Delta], None] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a prompt; RequestError when it cannot be served as asked, ServerFullError when the queue is full."""
        params = params.check(self.vocab_size)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise RequestError(
                f"the prompt holds token ids outside the vocabulary (0..{self.vocab_size - 1})", "prompt"
            )
        total = len(prompt) + params.max_tokens
        if total > self.max_positions:
            raise RequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is {total} tokens, more than "
                f"this model's context of {self.max_positions}; shorten the prompt or ask for fewer tokens",
                "max_tokens",
            )
        if self._pages_needed(len(prompt), params) > self.pool.capacity:
            raise RequestError(
                f"the request needs more KV-cache pages than the pool has ({self.pool.capacity}); "
                "ask for fewer tokens or start the server with more pages",
                "max_tokens",
            )
        with self._lock:
            if self._inbox.qsize() + len(self._waiting) >= self.config.max_waiting:
                raise ServerFullError(f"{self.config.max_waiting} requests are already waiting")
            self._count += 1
            request_id = request_id or f"req-{self._count}"
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        request = Request(request_id, prompt, params, seed % 2**32, on_delta)
        self._inbox.put(request)
        return request

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams = SamplingParams()) -> list[list[ChoiceOutput]]:
        """Every prompt's choices, computed in-process by stepping the engine until all are done."""
        if self._thread is not None:
            raise RuntimeError("generate() steps the engine itself; the engine's thread is running (use submit)")
        requests = [self.submit(p, params) for p in prompts]
        while not all(r.done for r in requests):
            self.step()
        return [r.wait() for r in requests]

    def _pages_needed(self, prompt_len: int, params: SamplingParams) -> int:
        # The last generated token is never fed back, so it needs no slot.
        return self.pool.pages_for(max(prompt_len, prompt_len + params.max_tokens - 1))

    # ---- the loop ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the engine's loop in a thread of its own."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="lm-train-engine", daemon=True)
            self._thread.start()

    def stop(self, cancel: bool = True) -> None:
        """Stop the loop (cancelling the requests in flight, or first finishing them) and join its thread."""
        if self._thread is None:
            return
        if cancel:
            for seq in [*self._running, *self._waiting]:
                seq.request.cancel()
        else:
            while self.busy:
                self._stop.wait(0.01)
        self._stop.set()
        self._thread.join()
        self._thread = None
        if cancel:
            self.step()  # the cancelled requests finish and free their pages

    @property
    def busy(self) -> bool:
        return bool(self._running or self._waiting or not self._inbox.empty())

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.busy:
                try:
                    self._take(timeout=0.05)
                except queue.Empty:
                    continue
            try:
                self.step()
            except Exception as error:  # the server must outlive a failed step: fail the requests, keep serving
                log.exception("engine step failed")
                self._fail_all(error)

    def _take(self, timeout: float) -> None:
        request = self._inbox.get(timeout=timeout)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        for choice in range(request.params.n):
            self._waiting.append(Sequence(request, choice, request.prompt))

    def _fail_all(self, error: BaseException) -> None:
        for seq in [*self._running, *self._waiting]:
            self._release(seq)
            if not seq.request.done:
                seq.request._fail(error)
        self._running, self._waiting = [], deque()
        self._slots = [None] * self.config.max_seqs

    # ---- one step ---------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, compute one prefill chunk for the prompts being read, then one token for every
        sequence being decoded."""
        while True:
            try:
                self._enqueue(self._inbox.get_nowait())
            except queue.Empty:
                break
        for seq in [s for s in self._running if s.request.cancelled]:
            self._finish(seq, "cancelled")
        for seq in [s for s in self._waiting if s.request.cancelled]:
            self._waiting.remove(seq)
            seq.finish_reason = "cancelled"
            seq.request._finish_choice(ChoiceOutput(seq.choice, "", [], None, "cancelled"))
        self._admit()
        prefilling = [s for s in self._running if s.prefilling][: self.config.prefill_rows]
        if prefilling:
            self._prefill(prefilling)
        decoding = [s for s in self._running if not s.prefilling and s.finish_reason is None]
        if decoding:
            self._decode(decoding)

    def _admit(self) -> None:
        kept: deque[Sequence] = deque()
        while self._waiting:
            seq = self._waiting.popleft()
            leader_busy = seq.choice > 0 and any(
                s.request is seq.request and s.choice == 0 and s.prefilling for s in [*self._running, *self._waiting]
            )
            free_slot = next((i for i, s in enumerate(self._slots) if s is None), None)
            if leader_busy or free_slot is None or not self._try_start(seq, free_slot):
                kept.append(seq)
                if free_slot is None:
                    break
        kept.extend(self._waiting)
        self._waiting = kept

    def _try_start(self, seq: Sequence, slot: int) -> bool:
        params = seq.request.params
        # A prompt whose log-probs are asked for is computed whole; the last token is always computed.
        shared = [] if params.prompt_logprobs else self.pool.share_prefix(seq.prompt[:-1])
        needed = self._pages_needed(len(seq.prompt), params) - len(shared)
        if not self.pool.try_reserve(needed):
            self.pool.release(shared)
            return False
        seq.pages, seq.reserved = list(shared), needed
        seq.computed = seq.first_computed = len(shared) * self.pool.page_size
        seq.registered = len(shared)
        seq.slot = slot
        self._slots[slot] = seq
        self._running.append(seq)
        return True

    def _grow(self, seq: Sequence, last_position: int) -> None:
        while len(seq.pages) * self.pool.page_size <= last_position:
            seq.pages.append(self.pool.allocate())
            seq.reserved -= 1

    def _table(self, seq: Sequence | None) -> np.ndarray:
        row = np.full((self.pages_per_seq,), NULL_PAGE, np.int32)
        if seq is not None:
            row[: len(seq.pages)] = seq.pages
        return row

    def _rows(self, seqs: list[Sequence | None], chunk: int, starts: list[int], sizes: list[int]) -> StepRows:
        R = len(seqs)
        ids = np.zeros((R, chunk), np.int32)
        positions = np.zeros((R, chunk), np.int32)
        valid = np.zeros((R, chunk), bool)
        targets = np.zeros((R, chunk), np.int32)
        last = np.zeros((R,), np.int32)
        slot = np.full((R,), self.config.max_seqs, np.int32)
        reset = np.zeros((R,), bool)
        emit = np.zeros((R,), bool)
        temperature = np.zeros((R,), np.float32)
        top_k = np.zeros((R,), np.int32)
        top_p = np.ones((R,), np.float32)
        presence = np.zeros((R,), np.float32)
        frequency = np.zeros((R,), np.float32)
        seed = np.zeros((R,), np.uint32)
        choice = np.zeros((R,), np.int32)
        index = np.zeros((R,), np.int32)
        tables = np.zeros((R, self.pages_per_seq), np.int32)
        for r, seq in enumerate(seqs):
            if seq is None:
                continue
            start, size = starts[r], sizes[r]
            tokens = seq.tokens
            self._grow(seq, start + size - 1)
            tables[r] = self._table(seq)
            ids[r, :size] = tokens[start : start + size]
            positions[r, :size] = np.arange(start, start + size)
            positions[r, size:] = start + size - 1  # padding sits at the last real position: its keys go nowhere
            valid[r, :size] = True
            following = tokens[start + 1 : start + size + 1]
            targets[r, : len(following)] = following
            last[r] = size - 1
            slot[r] = seq.slot
            reset[r] = start == seq.first_computed
            emit[r] = start + size >= len(seq.prompt)
            p = seq.request.params
            temperature[r], top_k[r], top_p[r] = p.temperature, p.top_k, p.top_p
            presence[r], frequency[r] = p.presence_penalty, p.frequency_penalty
            seed[r], choice[r], index[r] = seq.request.seed, seq.choice, len(seq.generated)
        return StepRows(
            *(jnp.asarray(a) for a in (ids, positions, valid, tables, targets, last, slot, reset, emit)),
            *(jnp.asarray(a) for a in (temperature, top_k, top_p, presence, frequency, seed, choice, index)),
        )

    def _run(self, rows: StepRows):
        self.cache, self.counts, out = self.step_fn(self.model, self.cache, self.counts, rows)
        return out

    def _prefill(self, seqs: list[Sequence]) -> None:
        chunk, n = self.config.prefill_chunk, self.config.prefill_rows
        starts = [s.computed for s in seqs] + [0] * (n - len(seqs))
        sizes = [min(chunk, len(s.prompt) - s.computed) for s in seqs] + [0] * (n - len(seqs))
        rows = self._rows([*seqs, *[None] * (n - len(seqs))], chunk, starts, sizes)
        out = self._run(rows)
        want_prompt = any(s.request.prompt_logprobs is not None for s in seqs)
        token, logprob, top_ids, top_lp = (np.asarray(x) for x in out[:4])
        if want_prompt:
            t_lp, t_ids, t_top = (np.asarray(x) for x in out[4:])
        for r, seq in enumerate(seqs):
            start, size = starts[r], sizes[r]
            seq.computed = start + size
            request = seq.request
            if request.prompt_logprobs is not None and seq.choice == 0:
                k = request.params.logprobs or 0
                for i in range(size):
                    if start + i + 1 < len(seq.prompt):
                        request.prompt_logprobs.append(
                            TokenLogprob(
                                seq.prompt[start + i + 1],
                                float(t_lp[r, i]),
                                [(int(a), float(b)) for a, b in zip(t_ids[r, i, :k], t_top[r, i, :k], strict=True)],
                            )
                        )
            self._register_pages(seq)
            if not seq.prefilling:
                if request.params.max_tokens == 0:
                    self._finish(seq, "length")
                else:
                    self._accept(seq, int(token[r]), float(logprob[r]), top_ids[r], top_lp[r])

    def _register_pages(self, seq: Sequence) -> None:
        size = self.pool.page_size
        while (seq.registered + 1) * size <= min(seq.computed, len(seq.prompt)):
            i = seq.registered
            previous = seq.pages[i - 1] if i > 0 else NULL_PAGE
            self.pool.register(seq.pages[i], previous, seq.prompt[i * size : (i + 1) * size])
            seq.registered += 1

    def _decode(self, seqs: list[Sequence]) -> None:
        rows_of: list[Sequence | None] = [None] * self.config.max_seqs
        starts = [0] * self.config.max_seqs
        sizes = [0] * self.config.max_seqs
        for seq in seqs:
            rows_of[seq.slot] = seq
            starts[seq.slot], sizes[seq.slot] = len(seq.tokens) - 1, 1
        out = self._run(self._rows(rows_of, 1, starts, sizes))
        token, logprob, top_ids, top_lp = (np.asarray(x) for x in out[:4])
        for seq in seqs:
            seq.computed = len(seq.tokens)
            self._accept(seq, int(token[seq.slot]), float(logprob[seq.slot]), top_ids[seq.slot], top_lp[seq.slot])

    # ---- tokens, stops and finishing --------------------------------------------------------------------------

    def _accept(self, seq: Sequence, token: int, logprob: float, top_ids: np.ndarray, top_lp: np.ndarray) -> None:
        params = seq.request.params
        if token in params.stop_token_ids or (token == self.eos_token_id and not params.ignore_eos):
            self._finish(seq, "stop")
            return
        seq.generated.append(token)
        if params.logprobs is not None:
            k = params.logprobs
            top = [(int(a), float(b)) for a, b in zip(top_ids[:k], top_lp[:k], strict=True)]
            seq.logprobs.append(TokenLogprob(token, logprob, top))
        if params.stop or seq.request.on_delta is not None:
            seq.text = self.decode(seq.generated)
        for stop in params.stop:
            at = seq.text.find(stop)
            if at >= 0:
                seq.text = seq.text[:at]
                self._finish(seq, "stop")
                return
        if len(seq.generated) >= params.max_tokens:
            self._finish(seq, "length")
        elif seq.request.on_delta is not None:
            self._send(seq, None)

    def _send(self, seq: Sequence, finish_reason: str | None) -> None:
        text = seq.text
        if finish_reason is None:
            # Hold back what may be the start of a stop string, or half of a character.
            hold = max((len(s) - 1 for s in seq.request.params.stop), default=0)
            end = len(text) - hold
            while end > seq.sent_text and text[end - 1] == "\ufffd":
                end -= 1
        else:
            end = len(text)
        if end <= seq.sent_text and len(seq.generated) == seq.sent_tokens and finish_reason is None:
            return
        new_tokens = seq.generated[seq.sent_tokens :]
        logprobs = seq.logprobs[seq.sent_tokens :] if seq.request.params.logprobs is not None else None
        delta = Delta(seq.choice, text[seq.sent_text : max(end, seq.sent_text)], new_tokens, logprobs, finish_reason)
        seq.sent_text, seq.sent_tokens = max(end, seq.sent_text), len(seq.generated)
        seq.request.on_delta(delta)

    def _release(self, seq: Sequence) -> None:
        self.pool.release(seq.pages)
        self.pool.unreserve(seq.reserved)
        seq.pages, seq.reserved = [], 0
        if 0 <= seq.slot < len(self._slots) and self._slots[seq.slot] is seq:
            self._slots[seq.slot] = None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if not (seq.request.params.stop or seq.request.on_delta is not None):
            seq.text = self.decode(seq.generated)  # else _accept kept it current
        self._release(seq)
        if seq in self._running:
            self._running.remove(seq)
        if seq.request.on_delta is not None:
            self._send(seq, reason)
        logprobs = seq.logprobs if seq.request.params.logprobs is not None else None
        seq.request._finish_choice(ChoiceOutput(seq.choice, seq.text, list(seq.generated), logprobs, reason))
