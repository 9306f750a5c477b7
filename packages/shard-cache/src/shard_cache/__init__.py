"""Tokenize a corpus into a sharded Parquet cache with Ray; read it deterministically while it is being written."""

from importlib import metadata as _metadata

from shard_cache.build import BuildHandle, BuildResult, build_cache, start_build
from shard_cache.chat import ChatProcessor
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
from shard_cache.formats import RECORD_FORMATS, record_processor
from shard_cache.inputs import expand_inputs
from shard_cache.mixture import ExampleSource, MixtureExamples, MixtureExhaustedError, example_source, mixture_examples
from shard_cache.mixture_layout import MixtureLayout
from shard_cache.mixture_schedule import (
    MixtureConfigError,
    MixtureSchedule,
    parse_block_size,
    parse_stop_strategy,
    parse_train_weights,
)
from shard_cache.packing import PackedSequences, PackingStats, plan_packs
from shard_cache.processor import BatchProcessor, TokenizerProcessor, load_tokenizer
from shard_cache.progress import BuildMetrics
from shard_cache.ray_runtime import ensure_ray
from shard_cache.reader import CacheReader, open_cache
from shard_cache.records import BadRecord, LossSpans, PromptCompletionProcessor, RecordProcessor
from shard_cache.shuffle import EraShuffle, FeistelPermutation
from shard_cache.tokenizer_training import train_tokenizer
from shard_cache.verify import VerifyReport, inspect_cache, verify_cache

__version__ = _metadata.version("shard-cache")  # the installed distribution's: no copy to drift

__all__ = [
    "RECORD_FORMATS",
    "BadInputError",
    "BadRecord",
    "BatchProcessor",
    "BuildHandle",
    "BuildMetrics",
    "BuildResult",
    "CacheCorruptError",
    "CacheLockedError",
    "CacheMismatchError",
    "CacheReader",
    "ChatProcessor",
    "Documents",
    "EraShuffle",
    "EraShuffledExamples",
    "ExampleSource",
    "FeistelPermutation",
    "LossSpans",
    "MixtureConfigError",
    "MixtureExamples",
    "MixtureExhaustedError",
    "MixtureLayout",
    "MixtureSchedule",
    "PackedSequences",
    "PackingStats",
    "PermutedExamples",
    "PromptCompletionProcessor",
    "RecordProcessor",
    "ShardCacheError",
    "TokenWindows",
    "TokenizerProcessor",
    "build_cache",
    "ensure_ray",
    "example_source",
    "expand_inputs",
    "inspect_cache",
    "load_tokenizer",
    "mixture_examples",
    "open_cache",
    "parse_block_size",
    "parse_stop_strategy",
    "parse_train_weights",
    "plan_packs",
    "process_slice",
    "record_processor",
    "start_build",
    "train_tokenizer",
    "verify_cache",
]
