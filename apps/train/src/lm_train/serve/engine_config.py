"""The engine's bounds, and how many KV-cache pages fit in the memory given to it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    """The engine's bounds: they fix the compiled shapes, so requests of any length reuse the same programs."""

    page_size: int = 16
    # Pages in the pool (page 0 is reserved); None: as many as memory_fraction of free device memory holds.
    num_pages: int | None = None
    memory_fraction: float = 0.25
    max_seqs: int = 16  # sequences decoded together
    prefill_rows: int = 4  # prompts whose chunks are computed together in one prefill step
    prefill_chunk: int = 64  # prompt tokens per row and prefill step
    max_waiting: int = 256  # requests queued beyond the running ones; more are refused (ServerFullError)
    # Tokens decoded per row and host round trip while no request is waiting to join: more is faster decoding, at
    # the cost of up to that many steps' wait before a new request's prompt is read.
    decode_steps: int = 16

    def check(self) -> EngineConfig:
        for name in ("page_size", "max_seqs", "prefill_rows", "prefill_chunk", "max_waiting", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is reserved), got {self.num_pages}")
        if self.num_pages is None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        return self


class ServerFullError(RuntimeError):
    """Too many requests are waiting: try again later."""


def bytes_per_page(config: Any, page_size: int, dtype: Any) -> int:
    """Device bytes of one page: keys and values of page_size positions in every layer."""
    import jax.numpy as jnp  # here, so that the flags are checked before jax is imported

    return 2 * config.Layers.size * page_size * config.KVHeads.size * config.HeadSize.size * jnp.dtype(dtype).itemsize


def free_device_bytes() -> int:
    """Free memory of the first device (its allocator's figure; on CPU, the host's available memory)."""
    import jax

    stats = jax.devices()[0].memory_stats() if hasattr(jax.devices()[0], "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
