"""How long transient storage errors (connection refused, 5xx, throttling) are retried before a save fails."""

import threading
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff: up to `max_attempts` tries per request, waits doubling from `initial_delay`
    up to `max_delay` seconds (tensorstore adds jitter). The default gives up after about 45 s of outage."""

    max_attempts: int = 8
    initial_delay: float = 0.5
    max_delay: float = 16.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_delay <= 0 or self.max_delay < self.initial_delay:
            raise ValueError(
                f"{self} is not a retry policy: max_attempts must be >= 1 and 0 < initial_delay <= max_delay."
            )

    @property
    def bound_seconds(self) -> float:
        """The longest total wait between the attempts of one request (without jitter)."""
        return sum(min(self.initial_delay * 2**i, self.max_delay) for i in range(self.max_attempts - 1))

    def context_spec(self) -> dict[str, Any]:
        """The tensorstore context resources that apply this policy to the s3 and gcs kvstores."""
        retries = {
            "max_retries": self.max_attempts,
            "initial_delay": f"{self.initial_delay}s",
            "max_delay": f"{self.max_delay}s",
        }
        return {"s3_request_retries": dict(retries), "gcs_request_retries": dict(retries)}

    def describe(self) -> str:
        return f"{self.max_attempts} attempts over about {self.bound_seconds:.0f} s"


_lock = threading.Lock()
_policy = RetryPolicy()


def retry_policy() -> RetryPolicy:
    """The retry policy in force for every storage request dist_ckpt makes."""
    return _policy


def set_retry_policy(policy: RetryPolicy) -> RetryPolicy:
    """Use `policy` for every later storage request (arrays and metadata alike); returns the previous one."""
    global _policy
    if not isinstance(policy, RetryPolicy):
        raise TypeError(f"set_retry_policy takes a dist_ckpt.RetryPolicy, got {type(policy).__name__}.")
    with _lock:
        previous, _policy = _policy, policy
    return previous
