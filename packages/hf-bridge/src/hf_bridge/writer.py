"""Writing safetensors checkpoints: tensors planned into shards by size, each shard built and written in turn."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from .errors import HfBridgeError
from .reader import INDEX_FILE, SINGLE_FILE

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30, "TIB": 2**40}  # fmt: skip
# transformers checks this metadata to know the tensors' framework layout.
METADATA = {"format": "pt"}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB" or "2GiB" (decimal units like transformers)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match and match.group(2).upper() in UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * UNITS[match.group(2).upper()])
    raise HfBridgeError(f"max_shard_size={size!r} is not a size; use bytes (an int) or a string like '5GB' or '500MB'.")


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its key, its size in bytes, and how to make its data when its shard is written."""

    key: str
    nbytes: int
    make: Callable[[], np.ndarray]


def plan_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[list[PlannedTensor]]:
    """Tensors grouped in order into shards of at most max_shard_size bytes (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    used = 0
    for t in tensors:
        if shards[-1] and used + t.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return shards


def write_shards(directory: Path, shards: list[list[PlannedTensor]]) -> list[str]:
    """Write each shard (one in memory at a time) and, for several, the index; returns the file names."""
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        data = {t.key: np.ascontiguousarray(t.make()) for t in shard}
        save_file(data, str(directory / name), metadata=METADATA)
        weight_map.update(dict.fromkeys(data, name))
        del data
    if n > 1:
        total = sum(t.nbytes for shard in shards for t in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return names
