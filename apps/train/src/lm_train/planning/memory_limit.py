"""The memory a device really has for a run: an override, an accelerator's own allocator limit, or (CPU) the
host's available RAM under any cgroup limit, shared by the CPU devices of this process."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_train.errors import UserError

LIMIT_ENV = "LM_TRAIN_MEMORY_LIMIT"
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", re.IGNORECASE)


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes one device may use, and where the figure comes from (words for a message)."""

    per_device: int
    why: str


def parse_size(text: str, where: str = LIMIT_ENV) -> int:
    """Bytes from `123456`, `512MiB`, `20G` or `1.5GiB` (K, M, G and T are binary units)."""
    match = _SIZE.fullmatch(text)
    value = float(match.group(1)) * 1024 ** " kmgt".index(match.group(2).lower() or " ") if match else 0.0
    if value < 1:
        raise UserError(
            f"{where}={text!r} is not a memory size: give bytes, or a number with K, M, G or T (binary units), "
            f"e.g. {where}=20GiB, or unset it to use the memory the devices have."
        )
    return int(value)


def limit_override() -> int | None:
    """The per-device limit set by LM_TRAIN_MEMORY_LIMIT, if any."""
    text = os.environ.get(LIMIT_ENV, "").strip()
    return parse_size(text) if text else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_free_bytes(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's memory cgroup still allows (its limit less its usage, page cache it can drop aside);
    None without a limit."""
    for limit_file, usage_file, stat_file, cache_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
    ):
        limit = _read_int(root / limit_file)
        if limit is None or limit >= 2**60:  # v1 writes a huge number for no limit
            continue
        usage = (_read_int(root / usage_file) or 0) - _stat(root / stat_file, cache_key)
        return max(0, limit - max(0, usage))
    return None


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of the RAM that new allocations can get without swapping (MemAvailable)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_available_bytes() -> tuple[int, str]:
    """The RAM this process can still allocate, and where the figure comes from."""
    from lm_train.planning.devices import host_memory_bytes

    available = mem_available_bytes()
    found = (available, "available RAM (MemAvailable)") if available is not None else (host_memory_bytes(), "RAM")
    cgroup = cgroup_free_bytes()
    if cgroup is not None and cgroup < found[0]:
        found = (cgroup, "what the memory cgroup's limit leaves")
    return found


def device_memory_limit(devices: Sequence[Any]) -> MemoryLimit | None:
    """The bytes one of `devices` may use; None where that is unknown (an accelerator that reports no limit)."""
    override = limit_override()
    if override is not None:
        return MemoryLimit(override, LIMIT_ENV)
    first = devices[0]
    if first.platform == "cpu":
        import jax

        local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
        total, why = host_available_bytes()
        shared = f", shared by {len(local)} CPU devices" if len(local) > 1 else ""
        return MemoryLimit(total // len(local), f"{why}{shared}")
    stats = first.memory_stats() or {}
    if stats.get("bytes_limit"):
        return MemoryLimit(int(stats["bytes_limit"]), f"jax's allocator limit on each {first.device_kind}")
    return None
