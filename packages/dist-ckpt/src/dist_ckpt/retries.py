"""How long transient storage errors (connection refused, 5xx, throttling) are retried before a save fails.

The policy is storage_io's, shared by every package that reaches storage; here it is turned into the retry
settings of tensorstore's s3 and gcs kvstores.
"""

from typing import Any

import storage_io
from storage_io import retry_policy, set_retry_policy

__all__ = ["RetryPolicy", "retry_policy", "set_retry_policy", "tensorstore_retries"]


class RetryPolicy(storage_io.RetryPolicy):
    """Bounded exponential backoff: up to `max_attempts` tries per request, waits doubling from `initial_delay`
    up to `max_delay` seconds (tensorstore adds jitter). The default gives up after about 45 s of outage."""

    def context_spec(self) -> dict[str, Any]:
        """The tensorstore context resources that apply this policy to the s3 and gcs kvstores."""
        return tensorstore_retries(self)


def tensorstore_retries(policy: storage_io.RetryPolicy) -> dict[str, Any]:
    """The tensorstore context resources that apply `policy` to the s3 and gcs kvstores."""
    retries = {
        "max_retries": policy.max_attempts,
        "initial_delay": f"{policy.initial_delay}s",
        "max_delay": f"{policy.max_delay}s",
    }
    return {"s3_request_retries": dict(retries), "gcs_request_retries": dict(retries)}
