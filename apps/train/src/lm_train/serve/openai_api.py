"""OpenAI's request bodies read into engine parameters, and the engine's results written in OpenAI's shapes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .params import RequestError, SamplingParams
from .requests import ChoiceOutput, TokenLogprob

# Parameters of OpenAI's API that this server does not implement: asking for them is an error, not ignored.
UNSUPPORTED = ("suffix", "logit_bias", "tools", "tool_choice", "functions", "function_call", "response_format")


class BodyError(RequestError):
    """A body whose fields have the wrong JSON types (HTTP 422); RequestError itself is a value out of range (400)."""


@dataclass
class Parsed:
    """A request body read: the prompts (token ids), the sampling parameters, and what the response must hold."""

    model: str | None
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    echo: bool
    include_usage: bool
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


def _get(body: dict, name: str, kinds: type | tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BodyError(f"{name} must be of type {_names(kinds)}, got a boolean", name)
    if not isinstance(value, kinds):
        raise BodyError(f"{name} must be of type {_names(kinds)}, got {type(value).__name__}", name)
    return value


def _names(kinds: type | tuple) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise BodyError("stop must be a string or an array of strings", "stop")


def _common(body: dict, max_tokens: int, logprobs: int | None, prompt_logprobs: bool) -> SamplingParams:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, {}, []):
            raise RequestError(f"{name} is not supported by this server; leave it out", name)
    n = _get(body, "n", int, 1)
    best_of = _get(body, "best_of", int, n)
    if best_of != n:
        raise RequestError("best_of other than n is not supported; leave it out", "best_of")
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BodyError("stop_token_ids must be an array of integers", "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        top_k=_get(body, "top_k", int, 0) if body.get("top_k") != -1 else 0,
        seed=_get(body, "seed", int),
        stop=_stop(body),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        n=n,
        presence_penalty=float(_get(body, "presence_penalty", (int, float), 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", (int, float), 0.0)),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _stream_options(body: dict) -> bool:
    options = _get(body, "stream_options", dict, {})
    return bool(options.get("include_usage", False))


def parse_completion(body: dict, encode: Callable[[str], list[int]], context: int) -> Parsed:
    """A /v1/completions body: prompt (text, token ids, or a list of either), max_tokens (16), logprobs, echo."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [encode(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [encode(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if not all(isinstance(t, int) and not isinstance(t, bool) for p in prompt for t in p):
            raise BodyError("prompt: each array of token ids must hold integers only", "prompt")
        prompts = [list(p) for p in prompt]
    elif prompt is None:
        raise BodyError("prompt is required: a string, an array of strings, or token ids", "prompt")
    else:
        raise BodyError("prompt must be a string, an array of strings, or (arrays of) token ids", "prompt")
    echo = _get(body, "echo", bool, False)
    logprobs = _get(body, "logprobs", int)
    max_tokens = _get(body, "max_tokens", int, 16)
    params = _common(body, max_tokens, logprobs, prompt_logprobs=echo and logprobs is not None)
    stream, as_ids = _get(body, "stream", bool, False), _get(body, "return_tokens_as_token_ids", bool, False)
    return Parsed(body.get("model"), prompts, params, stream, echo, _stream_options(body), as_ids)


def parse_chat(body: dict, render: Callable[[list[dict]], list[int]], context: int) -> Parsed:
    """A /v1/chat/completions body: messages through the chat template; logprobs (bool) with top_logprobs."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BodyError("messages must be a non-empty array of {role, content} objects", "messages")
    prompt = render(messages)
    logprobs = None
    if _get(body, "logprobs", bool, False):
        logprobs = _get(body, "top_logprobs", int, 0)
    elif body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    default = max(1, context - len(prompt))
    max_tokens = _get(body, "max_completion_tokens", int, None)
    max_tokens = _get(body, "max_tokens", int, default) if max_tokens is None else max_tokens
    params = _common(body, max_tokens, logprobs, prompt_logprobs=False)
    stream, as_ids = _get(body, "stream", bool, False), _get(body, "return_tokens_as_token_ids", bool, False)
    return Parsed(body.get("model"), [prompt], params, stream, False, _stream_options(body), as_ids)


def completion_logprobs(
    entries: list[TokenLogprob], token_text: Callable[[int], str], first_token: int | None = None
) -> dict[str, list]:
    """Logprobs in the completions API's shape: tokens, token_logprobs, top_logprobs, text_offset. With echo, the
    prompt's first token leads, with null log-probs (nothing comes before it), as OpenAI's API gives it."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    if first_token is not None:
        tokens.append(token_text(first_token))
        token_logprobs.append(None)
        tops.append(None)
        offsets.append(0)
        offset = len(tokens[0])
    for entry in entries:
        text = token_text(entry.token)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        tops.append({token_text(t): lp for t, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str]) -> dict[str, list]:
    """Logprobs in the chat API's shape: content, a list of {token, logprob, bytes, top_logprobs}."""

    def one(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage counts."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finished_choices(outputs: list[list[ChoiceOutput]]) -> list[tuple[int, int, ChoiceOutput]]:
    """(choice index in the response, prompt index, output): prompt i's n choices are numbered i*n ... i*n+n-1."""
    flat = []
    for p, choices in enumerate(outputs):
        n = len(choices)
        flat.extend((p * n + c.index, p, c) for c in choices)
    return flat
