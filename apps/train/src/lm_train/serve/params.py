"""What a request asks of the sampler (OpenAI's parameters), checked before it reaches the engine."""

from __future__ import annotations

from dataclasses import dataclass

# Alternatives per token that a request may ask for (OpenAI allows up to 20 on chat, 5 on completions).
MAX_LOGPROBS = 20
# Stop token ids per request: the decode loop checks them on the device, in an array of fixed width.
MAX_STOP_TOKEN_IDS = 16


class RequestError(ValueError):
    """A request the engine cannot serve as asked; `param` names the parameter at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt: OpenAI's sampling parameters, with their defaults.

    temperature 0 is greedy. top_k 0 and top_p 1 keep every token. A `seed` makes the tokens a function of the
    prompt and these parameters alone, whatever else shares the batch; without one, the engine draws a seed.
    `logprobs` (0..20, or None for none) asks for the sampled token's log-probability and that many alternatives;
    `prompt_logprobs` (OpenAI's echo with logprobs) asks for the same at every prompt token after the first.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def check(self, vocab_size: int) -> SamplingParams:
        """These parameters, or a RequestError that names the first one out of range."""
        _int_in("max_tokens", self.max_tokens, 0 if self.prompt_logprobs else 1, None)
        _number_in("temperature", self.temperature, 0.0, 2.0)
        _number_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_in("top_k", self.top_k, 0, vocab_size)
        _int_in("n", self.n, 1, 64)
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _int_in("seed", self.seed, -(2**63), 2**63 - 1)
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop must be a non-empty string or a list of at most 4 of them", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                               f"{len(self.stop_token_ids)}", "stop_token_ids")  # fmt: skip
        for token in self.stop_token_ids:
            _int_in("stop_token_ids", token, 0, vocab_size - 1)
        return self


def check_request(prompt: list[int], params: SamplingParams, vocab_size: int, context: int) -> SamplingParams:
    """The parameters of a prompt of token ids, or a RequestError: ids outside the vocabulary, or more tokens than
    the model's context."""
    params = params.check(vocab_size)
    if not prompt:
        raise RequestError("the prompt is empty: give at least one token", "prompt")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise RequestError(f"the prompt holds token ids outside the vocabulary (0..{vocab_size - 1})", "prompt")
    total = len(prompt) + params.max_tokens
    if total > context:
        raise RequestError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is {total} tokens, more than "
            f"this model's context of {context}; shorten the prompt or ask for fewer tokens",
            "max_tokens",
        )
    return params


def _int_in(name: str, value, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise RequestError(f"{name} must be {bound}, got {value}", name)


def _number_in(name: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"{name} must be in {interval}, got {value}", name)
