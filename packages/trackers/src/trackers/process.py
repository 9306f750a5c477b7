"""Which process of a multi-process run this is, without importing jax for it."""

from __future__ import annotations

import sys


def current_process_index() -> int:
    """jax.process_index() when jax is already imported, else 0.

    Call it after `jax.distributed.initialize()`: asking jax earlier would start its backends too soon.
    """
    jax = sys.modules.get("jax")
    if jax is None:
        return 0
    return int(jax.process_index())
