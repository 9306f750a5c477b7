"""One table of accelerator chips (HBM, dense bf16 peak), and the peak FLOP/s that MFU divides by.

On CPU there is no data sheet: the peak is measured (the best rate of jitted f32 matmuls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache

import jax
import jax.numpy as jnp

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One accelerator: its name as `device_kind` shows it, its memory, and its dense bf16 peak (no sparsity)."""

    name: str
    hbm_bytes: int
    bf16_flops: float


# From the vendors' data sheets; matched against jax's `device_kind` by the longest name it contains.
CHIPS: tuple[Chip, ...] = (
    Chip("h200", 141 * GiB, 989e12),
    Chip("h100", 80 * GiB, 989e12),
    Chip("a100", 80 * GiB, 312e12),
    Chip("l4", 24 * GiB, 121e12),
    Chip("a10", 24 * GiB, 125e12),
    Chip("v100", 32 * GiB, 125e12),
    Chip("tpu v4", 32 * GiB, 275e12),
    Chip("tpu v5 lite", 16 * GiB, 197e12),
    Chip("tpu v5e", 16 * GiB, 197e12),
    Chip("tpu v5p", 95 * GiB, 459e12),
    Chip("tpu v6 lite", 32 * GiB, 918e12),
)


def chip_for_kind(kind: str) -> Chip | None:
    """The table's chip for a device kind such as 'NVIDIA H100 80GB HBM3' or 'TPU v4', or None."""
    kind = kind.lower()
    for chip in sorted(CHIPS, key=lambda c: -len(c.name)):
        if chip.name in kind:
            return chip
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
    chip = chip_for_kind(getattr(device, "device_kind", ""))
    return chip.bf16_flops if chip is not None else measured_cpu_peak()
