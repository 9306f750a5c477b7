"""Peak FLOP/s of the devices, the denominator of MFU: a table for accelerators, a measurement on CPU."""

from __future__ import annotations

import time
from functools import cache

import jax
import jax.numpy as jnp

# Dense bf16 peak per chip, from the vendors' data sheets (no sparsity).
_ACCELERATOR_PEAKS = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "a10": 125e12,
    "v100": 125e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v6 lite": 918e12,
}


def _table_peak(kind: str) -> float | None:
    kind = kind.lower()
    for name, peak in sorted(_ACCELERATOR_PEAKS.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return peak
    return None


@cache
def measured_cpu_peak(size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of a jitted f32 matmul on one CPU device: the best of a few runs."""
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops_per_device(device: jax.Device | None = None) -> float:
    """Peak FLOP/s of one device: the data-sheet figure for known accelerators, else measured."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # Forced host devices share the same cores: the machine's peak is split between them.
        return measured_cpu_peak() / max(1, jax.local_device_count())
    return _table_peak(getattr(device, "device_kind", "")) or measured_cpu_peak()
