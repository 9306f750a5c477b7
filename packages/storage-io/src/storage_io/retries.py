"""Retries with bounded exponential backoff for transient storage failures (an endpoint down, throttling, 5xx)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from storage_io.errors import classify

T = TypeVar("T")
# Status words of a request that a later attempt may pass (throttling, 5xx, a dropped connection).
_TRANSIENT_WORDS = (
    "SlowDown",
    "Throttl",
    "TooManyRequests",
    "ServiceUnavailable",
    "InternalError",
    "500 Internal",
    "502 Bad Gateway",
    "503 Service",
    "504 Gateway",
)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: up to `max_attempts` tries per request, waits doubling from `initial_delay`
    up to `max_delay` seconds (with jitter). The default gives up after about 45 s of outage."""

    max_attempts: int = 8
    initial_delay: float = 0.5
    max_delay: float = 16.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_delay <= 0 or self.max_delay < self.initial_delay:
            raise ValueError(
                f"{self} is not a retry policy: max_attempts must be >= 1 and 0 < initial_delay <= max_delay."
            )

    def delays(self) -> list[float]:
        """The waits between attempts, without jitter."""
        return [min(self.initial_delay * 2**i, self.max_delay) for i in range(self.max_attempts - 1)]

    @property
    def bound_seconds(self) -> float:
        """The longest total wait between the attempts of one request (without jitter)."""
        return sum(self.delays())

    def describe(self) -> str:
        return f"{self.max_attempts} attempts over about {self.bound_seconds:.0f} s"


_lock = threading.Lock()
_policy = RetryPolicy()


def retry_policy() -> RetryPolicy:
    """The retry policy in force for storage requests."""
    return _policy


def set_retry_policy(policy: RetryPolicy) -> RetryPolicy:
    """Use `policy` for every later storage request; returns the previous one."""
    global _policy
    if not isinstance(policy, RetryPolicy):
        raise TypeError(f"set_retry_policy takes a RetryPolicy, got {type(policy).__name__}.")
    with _lock:
        previous, _policy = _policy, policy
    return previous


def is_transient(error: BaseException) -> bool:
    """Whether a later attempt may succeed: the store did not answer, throttled, or failed on its side."""
    reason = classify(error)
    if reason != "other":  # a missing file, a denial or a full disk stays so: only the unexplained are read
        return reason == "unreachable"
    text = str(error)
    return any(word in text for word in _TRANSIENT_WORDS)


def with_retries(
    fn: Callable[[], T], policy: RetryPolicy | None = None, *, sleep: Callable[[float], None] = time.sleep
) -> T:
    """fn(), tried again after transient failures as `policy` says; the last failure propagates."""
    policy = policy or retry_policy()
    delays = policy.delays()
    for attempt in range(policy.max_attempts):
        try:
            return fn()
        except Exception as error:
            if attempt == policy.max_attempts - 1 or not is_transient(error):
                raise
            sleep(delays[attempt] * (0.5 + random.random() / 2))  # jitter: writers that failed together spread out
    raise AssertionError("unreachable")
