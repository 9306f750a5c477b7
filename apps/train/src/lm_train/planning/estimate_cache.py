"""A run's peak estimate kept between runs: a rerun (a resume) of the same config on the same devices traces nothing.

Tracing the step costs seconds (gpt2_nano: ~3.5 s on 2 cores), the same on every rerun. The key is the resolved
config (less where its files go), the vocabulary, the devices, the kind of training, the versions of jax and the
workspace packages, and the size and time of each planner source file, so a change to any of them traces again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from lm_train.run.user_cache import kept_or_computed, user_cache_file

MAX_ENTRIES = 256  # the oldest go first; an entry is one line of JSON


def estimate_cache_file() -> str:
    """Where this user's estimates are kept: $XDG_CACHE_HOME (or ~/.cache)/lm-train/estimates.json."""
    return user_cache_file("estimates.json")


def _versions() -> list[str]:
    found = []
    for name in ("jax", "jaxlib", "lm-train", "lm-models", "named-tensors"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return found


def _planner_sources() -> list[str]:
    here = Path(__file__).parent
    return [f"{p.name} {p.stat().st_size} {p.stat().st_mtime_ns}" for p in sorted(here.glob("*.py"))]


def estimate_key(config_yaml: str, vocab_size: int, devices: str, kind: str) -> str:
    """The key of an estimate: a hash of everything it depends on."""
    parts = [config_yaml, str(vocab_size), devices, kind, *_versions(), *_planner_sources()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def cached_estimate(key: str, compute: Callable[[], int]) -> int:
    """The estimate kept under `key`, or `compute()`'s, kept for next time (a read-only home: not kept)."""
    return kept_or_computed(estimate_cache_file(), key, int, compute, indent=0, max_entries=MAX_ENTRIES)
