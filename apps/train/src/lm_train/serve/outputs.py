"""What a sampled token does to its sequence: stop tokens, stop strings and max_tokens; and the deltas streamed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .requests import Delta, Sequence, TokenLogprob


def accept_token(
    seq: Sequence,
    token: int,
    logprob: float,
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
    eos_token_id: int | None,
    decode: Callable[[list[int]], str],
) -> str | None:
    """Add a sampled token to its sequence; the finish reason ("stop", "length") if the sequence is done."""
    params = seq.request.params
    if token in params.stop_token_ids or (token == eos_token_id and not params.ignore_eos):
        return "stop"  # the stop token itself is not part of the output
    seq.generated.append(token)
    if params.logprobs is not None:
        k = params.logprobs
        top = [(int(a), float(b)) for a, b in zip(top_ids[:k], top_logprobs[:k], strict=True)]
        seq.logprobs.append(TokenLogprob(token, logprob, top))
    if params.stop or seq.request.on_delta is not None:
        seq.text = decode(seq.generated)
    for stop in params.stop:
        at = seq.text.find(stop)
        if at >= 0:
            seq.text = seq.text[:at]
            return "stop"
    if len(seq.generated) >= params.max_tokens:
        return "length"
    return None


def accept_call(
    seq: Sequence,
    tokens: np.ndarray,
    logprobs: np.ndarray,
    top: tuple[np.ndarray, np.ndarray] | None,
    produced: int,
    eos_token_id: int | None,
    decode: Callable[[list[int]], str],
) -> str | None:
    """Add the first `produced` tokens of a decode call's column for this sequence (top: their alternatives, when
    asked) until one ends it; its finish reason, if one did: what the device sampled after it is dropped."""
    none = np.zeros((0,), np.int32)
    for i in range(produced):
        seq.computed = len(seq.tokens)  # the token fed at this step is in the cache now
        ids, lps = (top[0][i], top[1][i]) if top is not None else (none, none)
        reason = accept_token(seq, int(tokens[i]), float(logprobs[i]), ids, lps, eos_token_id, decode)
        if reason is not None:
            return reason
    return None


def record_prompt_logprobs(
    seq: Sequence, start: int, size: int, logprobs: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
) -> None:
    """Keep the log-prob of each prompt token that follows the chunk's tokens start ... start + size - 1."""
    k = seq.request.params.logprobs or 0
    for i in range(size):
        if start + i + 1 < len(seq.prompt):
            top = [(int(a), float(b)) for a, b in zip(top_ids[i, :k], top_logprobs[i, :k], strict=True)]
            seq.request.prompt_logprobs.append(TokenLogprob(seq.prompt[start + i + 1], float(logprobs[i]), top))


def send_delta(seq: Sequence, finish_reason: str | None) -> None:
    """Give the request's on_delta what the sequence produced since the last delta (all of it when finished)."""
    text = seq.text
    end = len(text)
    if finish_reason is None:
        # Hold back what may be the start of a stop string, or half of a character.
        end -= max((len(s) - 1 for s in seq.request.params.stop), default=0)
        while end > seq.sent_text and text[end - 1] == "\ufffd":
            end -= 1
    end = max(end, seq.sent_text)
    if finish_reason is None and end == seq.sent_text and len(seq.generated) == seq.sent_tokens:
        return
    tokens = seq.generated[seq.sent_tokens :]
    logprobs = seq.logprobs[seq.sent_tokens :] if seq.request.params.logprobs is not None else None
    seq.request.on_delta(Delta(seq.choice, text[seq.sent_text : end], tokens, logprobs, finish_reason))
    seq.sent_text, seq.sent_tokens = end, len(seq.generated)
