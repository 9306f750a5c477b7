"""The serving engine: continuous batching of requests over a paged KV cache, with chunked prefill and per-request
sampling. It takes a model (params in memory) and token ids, and knows no HTTP."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import jax.numpy as jnp
import numpy as np

from lm_models import inference_mode, init_paged_cache, supports_paging

from .decoding import Decoder
from .engine_config import EngineConfig, ServerFullError, bytes_per_page, free_device_bytes
from .outputs import accept_token, record_prompt_logprobs, send_delta
from .pages import PagePool
from .params import RequestError, SamplingParams, check_request
from .requests import ChoiceOutput, Delta, Request, Sequence
from .rows import build_rows
from .step import EngineStep

__all__ = ["Engine", "EngineConfig", "ServerFullError"]  # the engine's settings and errors come with it

log = logging.getLogger(__name__)


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
        self.step_fn = EngineStep(config.decode_steps)
        self.decoder = Decoder(self.step_fn, config.max_seqs, self.pages_per_seq, eos_token_id)
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._slots: list[Sequence | None] = [None] * config.max_seqs
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._count = 0
        self._lock = threading.Lock()

    def submit(
        self,
        prompt: Seq[int],
        params: SamplingParams = SamplingParams(),
        *,
        on_delta: Callable[[Delta], None] | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a prompt; RequestError when it cannot be served as asked, ServerFullError when the queue is full."""
        prompt = [int(t) for t in prompt]
        params = check_request(prompt, params, self.vocab_size, self.max_positions)
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

    def stats(self) -> dict[str, int]:
        """The pool's pages (capacity, free, in use, reserved) and the sequences running and waiting, read from any
        thread (a snapshot: the engine's thread may move on)."""
        return {**self.pool.stats(), "running": len(self._running), "waiting": len(self._waiting) + self._inbox.qsize()}

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
            if seq.request.on_delta is not None:
                seq.request.on_delta(Delta(seq.choice, "", [], None, "error"))
        self._running, self._waiting = [], deque()
        self._slots = [None] * self.config.max_seqs
        self.decoder.reset()

    # ---- one step ---------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Admit what fits, compute one prefill chunk for the prompts being read, then dispatch a decode call for
        every sequence being decoded and take in the tokens of the call before it."""
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
        if self.decoder.active:
            self._decode()

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

    def _prefill(self, seqs: list[Sequence]) -> None:
        chunk, n = self.config.prefill_chunk, self.config.prefill_rows
        starts = [s.computed for s in seqs] + [0] * (n - len(seqs))
        sizes = [min(chunk, len(s.prompt) - s.computed) for s in seqs] + [0] * (n - len(seqs))
        padded = [*seqs, *[None] * (n - len(seqs))]
        rows = build_rows(padded, chunk, starts, sizes, self.pool, self.pages_per_seq, self.config.max_seqs)
        self.cache, self.counts, out = self.step_fn(self.model, self.cache, self.counts, rows)
        token, logprob, top_ids, top_lp = (np.asarray(x) for x in out[:4])
        # The prompt's log-probs come back from the device only when a request asks for them.
        prompt_scores = [np.asarray(x) for x in out[4:]] if any(s.request.prompt_logprobs for s in seqs) else None
        for r, seq in enumerate(seqs):
            start, size = starts[r], sizes[r]
            seq.computed = start + size
            if prompt_scores is not None and seq.request.prompt_logprobs is not None and seq.choice == 0:
                record_prompt_logprobs(seq, start, size, *(x[r] for x in prompt_scores))
            seq.registered = self.pool.register_prompt(seq.pages, seq.prompt, seq.registered, seq.computed)
            if not seq.prefilling:
                if seq.request.params.max_tokens == 0:
                    self._finish(seq, "length")
                else:
                    self._accept(seq, int(token[r]), float(logprob[r]), top_ids[r], top_lp[r])
                    if seq.finish_reason is None:
                        self.decoder.join(seq)

    def _decode(self) -> None:
        # k tokens per call, but one while a prompt is read or could join: its prefill waits one decode step, not k.
        joining = any(s.prefilling for s in self._running) or not self._inbox.empty()
        steps = 1 if joining or (self._waiting and None in self._slots) else self.config.decode_steps
        self.cache, self.counts, finished = self.decoder.advance(
            self.model, self.cache, self.counts, steps, self.pool, self.decode, self._release
        )
        for seq, reason in finished:
            self._finish(seq, reason)

    # ---- tokens, stops and finishing --------------------------------------------------------------------------

    def _accept(self, seq: Sequence, token: int, logprob: float, top_ids: np.ndarray, top_lp: np.ndarray) -> None:
        reason = accept_token(seq, token, logprob, top_ids, top_lp, self.eos_token_id, self.decode)
        if reason is not None:
            self._finish(seq, reason)
        elif seq.request.on_delta is not None:
            send_delta(seq, None)

    def _release(self, seq: Sequence) -> None:
        self.decoder.leave(seq)
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
        logprobs = seq.logprobs if seq.request.params.logprobs is not None else None
        # Done before the last delta goes out, so that whoever that delta wakes finds the request finished.
        seq.request._finish_choice(ChoiceOutput(seq.choice, seq.text, list(seq.generated), logprobs, reason))
        if seq.request.on_delta is not None:
            send_delta(seq, reason)
