"""Hardware named by a device spec (`cpu:8`, `8xH100`, `4x8xA100`, `v4-256`, `v5e-64`), or the devices present.

A spec needs no such hardware: `lm-train plan` sizes a run for a machine the user does not have yet.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from lm_train.errors import UserError
from lm_train.run.chips import CHIPS, Chip, chip_for_kind, chip_named

_GPU_SPEC = re.compile(r"^(?:(\d+)\s*x\s*)?(\d+)\s*x\s*([A-Za-z][\w.-]*)$")
_TPU_SPEC = re.compile(r"^(v\d+[a-z]*)-(\d+)$", re.IGNORECASE)
_CPU_SPEC = re.compile(r"^cpu(?::(\d+))?$", re.IGNORECASE)


@dataclass(frozen=True)
class DeviceSpec:
    """How many devices (as jax counts them), of which chip, on how many hosts; per-device memory and peak."""

    text: str
    count: int
    chip: Chip | None
    """None for CPU devices, whose peak is measured and whose memory is the host's."""
    hosts: int = 1
    cpu_memory_bytes: int = 0

    @property
    def platform(self) -> str:
        return "cpu" if self.chip is None else self.chip.platform

    @property
    def memory_bytes(self) -> int:
        """Memory of one device: its HBM, or (CPU) an equal share of the host's RAM."""
        if self.chip is not None:
            return self.chip.hbm_bytes
        return self.cpu_memory_bytes // max(1, self.count)

    def describe(self) -> str:
        if self.chip is None:
            plural = "s" if self.count > 1 else ""
            return f"{self.count} CPU device{plural} (sharing {self.cpu_memory_bytes / 2**30:.0f} GiB of RAM)"
        per_host = f" on {self.hosts} hosts" if self.hosts > 1 else ""
        return f"{self.count} x {self.chip.name}{per_host} ({self.chip.hbm_bytes / 2**30:.0f} GiB each)"


def host_memory_bytes() -> int:
    """This machine's RAM."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _known_chips() -> str:
    gpus = ", ".join(c.name for c in CHIPS if c.platform == "gpu")
    tpus = ", ".join(c.name for c in CHIPS if c.platform == "tpu")
    return f"GPUs {gpus}; TPUs {tpus}"


def _bad(text: str, why: str) -> UserError:
    return UserError(
        f"--devices {text!r}: {why}. Write e.g. `cpu:8`, `8xH100`, `64xH200`, `4x8xA100` (hosts x GPUs per host), "
        f"`v4-256` or `v5e-64` (a TPU slice); known chips: {_known_chips()}."
    )


def parse_devices(text: str) -> DeviceSpec:
    """The hardware a spec names; a UserError that shows the forms when it names none."""
    spec = text.strip()
    if m := _CPU_SPEC.match(spec):
        count = int(m.group(1) or os.cpu_count() or 1)
        if count < 1:
            raise _bad(text, "a run needs at least 1 device")
        return DeviceSpec(spec, count, None, cpu_memory_bytes=host_memory_bytes())
    if m := _TPU_SPEC.match(spec):
        chip = chip_named(m.group(1))
        if chip is None or chip.platform != "tpu":
            raise _bad(text, f"{m.group(1)!r} is not a TPU generation in the table")
        cores = int(m.group(2))
        if cores < 1:
            raise _bad(text, "a slice has at least one chip")
        if cores % chip.cores_per_chip:
            raise _bad(
                text, f"a {chip.name} slice counts {chip.cores_per_chip} cores per chip; {cores} is not a multiple"
            )
        chips = cores // chip.cores_per_chip
        return DeviceSpec(spec, chips, chip, hosts=max(1, math.ceil(chips / 4)))
    if m := _GPU_SPEC.match(spec):
        chip = chip_named(m.group(3))
        if chip is None:
            raise _bad(text, f"{m.group(3)!r} is not a chip in the table")
        hosts, per_host = int(m.group(1) or 1), int(m.group(2))
        if hosts < 1 or per_host < 1:
            raise _bad(text, "the counts must be at least 1")
        return DeviceSpec(spec, hosts * per_host, chip, hosts=hosts)
    raise _bad(text, "this is not a device spec")


def present_devices() -> DeviceSpec:
    """The devices jax sees here (all processes), as a spec."""
    import jax

    devices = jax.devices()
    first = devices[0]
    if first.platform == "cpu":
        return DeviceSpec(f"cpu:{len(devices)}", len(devices), None, cpu_memory_bytes=host_memory_bytes())
    chip = chip_for_kind(getattr(first, "device_kind", ""))
    if chip is None:
        raise UserError(
            f"The devices here are {first.device_kind!r}, which the chip table (lm_train.run.chips) does not know, so "
            "their memory and peak are unknown. Pass --devices with a known chip of the same size, e.g. --devices "
            f"{len(devices)}xH100."
        )
    return DeviceSpec(f"{len(devices)}x{chip.name}", len(devices), chip, hosts=jax.process_count())
