"""A request in the engine: its choices (sequences), what they produced, and how their results reach the caller."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .params import SamplingParams


@dataclass
class TokenLogprob:
    """A token with its log-probability and the most likely alternatives at its position (id, log-prob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """What one choice produced since the last delta: text, tokens and their log-probs; finish_reason at the end."""

    choice: int
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None


@dataclass
class ChoiceOutput:
    """A finished choice: its whole text, tokens, log-probs (when asked) and why it stopped."""

    index: int
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str


@dataclass
class Sequence:
    """One choice of a request as it runs: the prompt and generated tokens, its pages and its place in the batch."""

    request: Request
    choice: int
    prompt: list[int]
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    reserved: int = 0  # pages set aside for growth, not yet taken
    computed: int = 0  # tokens whose keys/values the cache holds
    first_computed: int = 0  # where its own prefill started (after a shared prefix)
    registered: int = 0  # whole prompt pages offered for sharing
    slot: int = -1  # row in the decode batch (and in the penalty counts)
    bound: int = 0  # tokens generated once the decode calls dispatched so far are read (at most)
    text: str = ""
    sent_text: int = 0  # characters of text already given out
    sent_tokens: int = 0  # generated tokens already given out
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


class Request:
    """A submitted prompt: `on_delta` (called from the engine's thread) gets each choice's progress; `wait()` gives
    the finished choices. `cancel()` stops it at the next step, freeing its pages."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        on_delta: Callable[[Delta], None] | None = None,
    ):
        self.id = request_id
        self.prompt = list(prompt)
        self.params = params
        self.seed = seed
        self.on_delta = on_delta
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if params.prompt_logprobs else None
        self.outputs: dict[int, ChoiceOutput] = {}
        self.error: BaseException | None = None
        self.cancelled = False
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Ask the engine to stop this request (it finishes with finish_reason "cancelled")."""
        self.cancelled = True

    def wait(self, timeout: float | None = None) -> list[ChoiceOutput]:
        """The finished choices, in order (raises the engine's error, if it failed)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return [self.outputs[i] for i in sorted(self.outputs)]

    def _finish_choice(self, output: ChoiceOutput) -> None:
        self.outputs[output.index] = output
        if len(self.outputs) == self.params.n:
            self._done.set()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._done.set()
