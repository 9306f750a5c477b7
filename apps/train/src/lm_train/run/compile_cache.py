"""JAX's persistent compilation cache for a run: a rerun of the same config loads its programs instead of
compiling them, and the log says which happened."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import jax

from lm_train.config.schema import TrainLmConfig

_CACHE_HITS = "/jax/compilation_cache/cache_hits"
_hits = 0
T = TypeVar("T")
_listening = False


def _count_hit(event: str, **_: object) -> None:
    global _hits
    if event == _CACHE_HITS:
        _hits += 1


def compilation_cache_dir(config: TrainLmConfig) -> str | None:
    """Where this run's compiled programs are kept; None when the cache is off.

    The user's own JAX setting ($JAX_COMPILATION_CACHE_DIR) wins over the default, which sits beside the data
    caches when those are on local disk (a bucket's round trips would cost more than most compiles here).
    """
    t = config.trainer
    if not t.compilation_cache:
        return None
    if t.compilation_cache_dir:
        return t.compilation_cache_dir
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    if "://" in config.data.cache_dir:
        return None
    return os.path.join(config.data.cache_dir, "jax-compiled")


def enable_compilation_cache(config: TrainLmConfig) -> str | None:
    """Point JAX at the run's cache before anything compiles (JAX decides at its first compile whether a cache
    is used); returns the directory, or None when off."""
    global _listening
    directory = compilation_cache_dir(config)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # a tiny model's step compiles in 1 s
    if not _listening:
        jax.monitoring.register_event_listener(_count_hit)
        _listening = True
    return directory


def timed_compile(what: str, compile_now: Callable[[], T], report: bool) -> T:
    """Run `compile_now` and say (on stderr, when `report`) how long it took, and whether the cache served it;
    returns what it returned."""
    hits, start = _hits, time.perf_counter()
    compiled = compile_now()
    seconds = time.perf_counter() - start
    if report:
        how = "loaded from the compilation cache" if _hits > hits else "compiled"
        print(f"{what}: {how} in {seconds:.1f} s", file=sys.stderr, flush=True)
    return compiled
