"""One table of accelerator chips (HBM, dense bf16 peak), and the peak FLOP/s that MFU divides by.

On CPU there is no data sheet: the peak is measured (the best rate of jitted f32 matmuls), once per machine.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp

from lm_train.run.user_cache import kept_or_computed, user_cache_file

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One accelerator: its name in device specs (`8xH100`, `v4-64`), its memory and its dense bf16 peak.

    `kinds` are the lower-case pieces that jax's `device_kind` contains for it (all of one entry must match);
    `cores_per_chip` is how many TensorCores a TPU slice name counts per chip (v4-64 is 32 chips).
    """

    name: str
    hbm_bytes: int
    bf16_flops: float
    platform: str = "gpu"
    kinds: tuple[tuple[str, ...], ...] = ()
    cores_per_chip: int = 1


# From the vendors' data sheets (dense, no sparsity), one device as jax sees it: a GPU, or a TPU chip.
CHIPS: tuple[Chip, ...] = (
    Chip("H200", 141 * GiB, 989e12, kinds=(("h200",),)),
    Chip("H100", 80 * GiB, 989e12, kinds=(("h100",),)),
    Chip("GH200", 96 * GiB, 989e12, kinds=(("gh200",),)),
    Chip("B200", 180 * GiB, 2250e12, kinds=(("b200",),)),
    Chip("A100-80", 80 * GiB, 312e12, kinds=(("a100", "80g"),)),
    Chip("A100-40", 40 * GiB, 312e12, kinds=(("a100", "40g"), ("a100",))),
    Chip("L40S", 48 * GiB, 362e12, kinds=(("l40s",),)),
    Chip("L4", 24 * GiB, 121e12, kinds=(("l4",),)),
    Chip("A10", 24 * GiB, 125e12, kinds=(("a10",),)),
    Chip("V100", 32 * GiB, 125e12, kinds=(("v100",),)),
    Chip("MI300X", 192 * GiB, 1307e12, kinds=(("mi300x",),)),
    Chip("v3", 16 * GiB, 123e12, "tpu", (("tpu v3",),), cores_per_chip=2),
    Chip("v4", 32 * GiB, 275e12, "tpu", (("tpu v4",),), cores_per_chip=2),
    Chip("v5e", 16 * GiB, 197e12, "tpu", (("tpu v5 lite",), ("tpu v5e",))),
    Chip("v5p", 95 * GiB, 459e12, "tpu", (("tpu v5p",), ("tpu v5",)), cores_per_chip=2),
    Chip("v6e", 32 * GiB, 918e12, "tpu", (("tpu v6 lite",), ("tpu v6e",))),
)
# Spellings of a chip in device specs besides its name (case does not matter).
CHIP_ALIASES = {"a100": "A100-40", "a100-40gb": "A100-40", "a100-80gb": "A100-80", "v5litepod": "v5e", "v6": "v6e"}


def chip_for_kind(kind: str) -> Chip | None:
    """The table's chip for a device kind such as 'NVIDIA H100 80GB HBM3' or 'TPU v4', or None."""
    kind = kind.lower()
    matches = [(sum(map(len, parts)), chip) for chip in CHIPS for parts in chip.kinds if all(p in kind for p in parts)]
    return max(matches, key=lambda m: m[0])[1] if matches else None


def chip_named(name: str) -> Chip | None:
    """The table's chip for a name in a device spec (`H100`, `a100-80`, `v5e`), or None."""
    key = CHIP_ALIASES.get(name.lower(), name).lower()
    return next((chip for chip in CHIPS if chip.name.lower() == key), None)


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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def cpu_peak_cache_file() -> str:
    """Where this user's measured CPU peaks are kept: $XDG_CACHE_HOME (or ~/.cache)/lm-train/cpu-peak.json."""
    return user_cache_file("cpu-peak.json")


def cpu_peak() -> float:
    """`measured_cpu_peak()`, measured once per machine and kept in `cpu_peak_cache_file()`.

    Measuring takes a second of every core, at the start of every run; the peak of a machine does not change
    between runs. The key names the CPU, the cores this process may use and the jax version, so a new machine
    or a new XLA measures again. Delete the file to measure again by hand.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    key = f"{_cpu_model()} | {cores} cores | jax {jax.__version__}"
    return kept_or_computed(cpu_peak_cache_file(), key, float, measured_cpu_peak, indent=1)


# `device` is a jax.Device or None; typed Any because jax exports Device as a variable bound to a class of
# compiled jaxlib, which ships no stub (a type checker can neither name it nor see its attributes).
def peak_flops_per_device(device: Any = None) -> float:
    """Peak FLOP/s of one device: the data-sheet figure for known accelerators, else measured."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # Forced host devices share the same cores: the machine's peak is split between them.
        return cpu_peak() / max(1, jax.local_device_count())
    chip = chip_for_kind(getattr(device, "device_kind", ""))
    return chip.bf16_flops if chip is not None else cpu_peak()
