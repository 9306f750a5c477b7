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
def measured_cpu_peak(sizes: tuple[int, ...] = (512, 1024), seconds_per_size: float = 0.5) -> float:
    """FLOP/s of jitted f32 matmuls on one CPU device: the best rate over a few sizes and repeats.

    The best rather than the mean, because other processes only ever slow a run down: the fastest repeat is
    the closest to what the hardware can do.
    """
    device = jax.devices("cpu")[0]
    best_rate = 0.0
    for size in sizes:
        a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
        matmul = jax.jit(lambda x: x @ x)
        matmul(a).block_until_ready()
        deadline = time.perf_counter() + seconds_per_size
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            matmul(a).block_until_ready()
            best_rate = max(best_rate, 2 * size**3 / (time.perf_counter() - start))
    return best_rate


def peak_flops_per_device(device: jax.Device | None = None) -> float:
    """Peak FLOP/s of one device: the data-sheet figure for known accelerators, else measured."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # Forced host devices share the same cores: the machine's peak is split between them.
        return measured_cpu_peak() / max(1, jax.local_device_count())
    return _table_peak(getattr(device, "device_kind", "")) or measured_cpu_peak()
