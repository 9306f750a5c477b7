"""Start a quiet local Ray on demand, or join an existing cluster."""

from __future__ import annotations

import os
import warnings
from typing import Any

QUIET_ENV = {
    # Under `uv run`, Ray would otherwise copy the whole workspace (.venv included) into every session.
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
}
OBJECT_STORE_BYTES = 256 * 2**20


def ensure_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None) -> Any:
    """Return the `ray` module, initialised: the running instance, the cluster at `address`/RAY_ADDRESS, or a
    new quiet local one (no dashboard, bounded object store)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    with warnings.catch_warnings():
        # JAX warns on every fork once it has started its threads. Ray's forks here start its daemons:
        # between fork and exec the child only sets a signal mask and a parent-death signal, and touches no
        # lock another thread could hold, so the deadlock JAX warns about cannot happen there; the warning
        # would only alarm every cold `lm-train run`.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # "local": a new instance of our own even when another cluster was started on this machine with
            # `ray start` (ray.init() would otherwise join that one, with its settings and its other users).
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=OBJECT_STORE_BYTES,
                _temp_dir=temp_dir,
            )
    return ray
