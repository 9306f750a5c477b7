"""The few multi-process operations dist_ckpt needs: who am I, a barrier, a broadcast from process 0."""

import jax
import numpy as np
from jax.experimental import multihost_utils


def process_index() -> int:
    """Index of this process in the jax distributed run (0 when single-process)."""
    return jax.process_index()


def process_count() -> int:
    """Number of processes in the jax distributed run."""
    return jax.process_count()


def barrier(name: str) -> None:
    """Block until every process reaches the barrier called `name` (no-op when single-process)."""
    if process_count() > 1:
        multihost_utils.sync_global_devices(name)


def broadcast_from_process_0(values: np.ndarray) -> np.ndarray:
    """Return process 0's `values` on every process (an int32 vector: jax without x64 has no int64)."""
    if process_count() == 1:
        return values
    return np.asarray(multihost_utils.broadcast_one_to_all(values))
