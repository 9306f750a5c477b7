"""One decode call of the engine: up to k tokens for each sequence being decoded, in one trip to the device and
back, accepted in order (the engine's loop calls it between prefill chunks)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .outputs import accept_call, send_delta
from .requests import Sequence
from .rows import build_decode_rows


def decode_call(engine: Any, seqs: list[Sequence]) -> None:
    """Decode `seqs` (each in its slot's row) on `engine` (a serve.engine.Engine): k tokens per row while nobody
    waits to join, else one; the tokens go to their sequences, which finish at a stop or max_tokens."""
    # Several tokens per call while nobody waits to join; one while a prompt is read or could be admitted, so
    # that a new request's prefill waits for one decode step, not k.
    joining = (
        any(s.prefilling for s in engine._running)
        or not engine._inbox.empty()
        or (bool(engine._waiting) and None in engine._slots)
    )
    steps = 1 if joining else engine.config.decode_steps
    rows = build_decode_rows(
        seqs,
        steps,
        engine.eos_token_id,
        engine.pool,
        engine.pages_per_seq,
        engine.config.max_seqs,
        engine.config.max_seqs,
    )
    engine.cache, engine.counts, out = engine.step_fn.decode(engine.model, engine.cache, engine.counts, rows)
    wants_top = any(s.request.params.logprobs for s in seqs)
    # One trip back for the call's tokens; the alternatives only when some request asked for them.
    tokens, logprob, produced = (np.asarray(x) for x in (out.tokens, out.logprob, out.produced))
    top_ids, top_lp = (np.asarray(out.top_ids), np.asarray(out.top_logprobs)) if wants_top else (None, None)
    for seq in seqs:
        r = seq.slot
        top = (top_ids[:, r], top_lp[:, r]) if top_ids is not None and top_lp is not None else None
        reason = accept_call(seq, tokens[:, r], logprob[:, r], top, int(produced[r]), engine.eos_token_id,
                             engine.decode)  # fmt: skip
        if reason is not None:
            engine._finish(seq, reason)
        elif seq.request.on_delta is not None:
            send_delta(seq, None)
