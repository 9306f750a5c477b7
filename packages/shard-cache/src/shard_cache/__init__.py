"""Tokenize a corpus into a sharded Parquet cache with Ray; read it deterministically while it is being written."""

from importlib import metadata as _metadata

from shard_cache.build import BuildHandle, BuildResult, build_cache, start_build
from shard_cache.errors import (
    BadInputError,
    CacheCorruptError,
    CacheLockedError,
    CacheMismatchError,
    ShardCacheError,
)
from shard_cache.examples import (
    Documents,
    EraShuffledExamples,
    PermutedExamples,
    TokenWindows,
    process_slice,
)
from shard_cache.inputs import expand_inputs
from shard_cache.processor import BatchProcessor, TokenizerProcessor, load_tokenizer
from shard_cache.progress import BuildMetrics
from shard_cache.ray_runtime import RayCluster, ensure_ray, find_coordinator_host, start_ray_cluster
from shard_cache.reader import CacheReader, open_cache
from shard_cache.shuffle import EraShuffle, FeistelPermutation
from shard_cache.tokenizer_training import train_tokenizer
from shard_cache.verify import VerifyReport, inspect_cache, verify_cache

__version__ = _metadata.version("shard-cache")  # the installed distribution's: no copy to drift

__all__ = [
    "BadInputError",
    "BatchProcessor",
    "BuildHandle",
    "BuildMetrics",
    "BuildResult",
    "CacheCorruptError",
    "CacheLockedError",
    "CacheMismatchError",
    "CacheReader",
    "Documents",
    "EraShuffle",
    "EraShuffledExamples",
    "FeistelPermutation",
    "PermutedExamples",
    "RayCluster",
    "ShardCacheError",
    "TokenWindows",
    "TokenizerProcessor",
    "build_cache",
    "ensure_ray",
    "expand_inputs",
    "find_coordinator_host",
    "inspect_cache",
    "load_tokenizer",
    "open_cache",
    "process_slice",
    "start_build",
    "start_ray_cluster",
    "train_tokenizer",
    "verify_cache",
]
