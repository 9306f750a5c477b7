"""Tokenize a corpus into a sharded Parquet cache with Ray; read it deterministically while it is being written."""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

# Public names and the module that defines each. They are imported on first use (PEP 562), so that a command
# such as `shard-cache inspect` does not load pyarrow, tokenizers and Ray just to print a JSON summary.
_EXPORTS = {
    "BadInputError": "shard_cache.errors",
    "BadRecord": "shard_cache.records",
    "BatchProcessor": "shard_cache.processor",
    "BatchSchedule": "shard_cache.batch_schedule",
    "BuildHandle": "shard_cache.build",
    "BuildMetrics": "shard_cache.progress",
    "BuildResult": "shard_cache.build",
    "CacheCorruptError": "shard_cache.errors",
    "CacheLockedError": "shard_cache.errors",
    "CacheMismatchError": "shard_cache.errors",
    "CacheReader": "shard_cache.reader",
    "ChatProcessor": "shard_cache.chat",
    "ChunkCorruptError": "shard_cache.errors",
    "DocumentReader": "shard_cache.sources",
    "Documents": "shard_cache.examples",
    "EraShuffle": "shard_cache.shuffle",
    "EraShuffledExamples": "shard_cache.examples",
    "ExampleSource": "shard_cache.mixture",
    "FeistelPermutation": "shard_cache.shuffle",
    "LossSpans": "shard_cache.records",
    "MixtureConfigError": "shard_cache.mixture_schedule",
    "MixtureExamples": "shard_cache.mixture",
    "MixtureExhaustedError": "shard_cache.mixture",
    "MixtureLayout": "shard_cache.mixture_layout",
    "MixtureSchedule": "shard_cache.mixture_schedule",
    "PackedSequences": "shard_cache.packing",
    "PackingStats": "shard_cache.packing",
    "PermutedExamples": "shard_cache.examples",
    "PREFERENCE_FORMATS": "shard_cache.preference_records",
    "PreferenceChatProcessor": "shard_cache.preference_records",
    "PreferencePairs": "shard_cache.preferences",
    "PreferenceProcessor": "shard_cache.preference_records",
    "PromptCompletionProcessor": "shard_cache.records",
    "PromptProcessor": "shard_cache.prompt_records",
    "PromptRecords": "shard_cache.prompt_records",
    "prompt_settings_digest": "shard_cache.prompt_records",
    "RayCluster": "shard_cache.ray_runtime",
    "RECORD_FORMATS": "shard_cache.formats",
    "RecordProcessor": "shard_cache.records",
    "RepairReport": "shard_cache.repair",
    "SETTINGS_NAME": "shard_cache.ledger",
    "ShardCacheError": "shard_cache.errors",
    "StorageError": "shard_cache.errors",
    "TokenWindows": "shard_cache.examples",
    "TokenizerFileError": "shard_cache.errors",
    "TokenizerProcessor": "shard_cache.processor",
    "VerifyReport": "shard_cache.verify",
    "build_cache": "shard_cache.build",
    "ensure_ray": "shard_cache.ray_runtime",
    "example_source": "shard_cache.mixture",
    "expand_inputs": "shard_cache.inputs",
    "find_coordinator_host": "shard_cache.ray_runtime",
    "get_fs": "shard_cache.fs",
    "inspect_cache": "shard_cache.verify",
    "join": "shard_cache.fs",
    "load_tokenizer": "shard_cache.processor",
    "mixture_examples": "shard_cache.mixture",
    "open_cache": "shard_cache.opening",
    "parse_block_size": "shard_cache.mixture_schedule",
    "parse_stop_strategy": "shard_cache.mixture_schedule",
    "parse_train_weights": "shard_cache.mixture_schedule",
    "plan_packs": "shard_cache.packing",
    "preference_processor": "shard_cache.preference_records",
    "process_slice": "shard_cache.examples",
    "read_bytes": "shard_cache.fs",
    "record_processor": "shard_cache.formats",
    "repair_cache": "shard_cache.repair",
    "start_build": "shard_cache.build",
    "start_ray_cluster": "shard_cache.ray_runtime",
    "string_field": "shard_cache.records",
    "train_tokenizer": "shard_cache.tokenizer_training",
    "verify_cache": "shard_cache.verify",
    "write_atomic": "shard_cache.fs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's: no copy to drift (read on use: it costs ~50 ms)
        globals()[name] = _metadata.version("shard-cache")
        return globals()[name]
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shard_cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from shard_cache.batch_schedule import BatchSchedule
    from shard_cache.build import BuildHandle, BuildResult, build_cache, start_build
    from shard_cache.chat import ChatProcessor
    from shard_cache.errors import (
        BadInputError,
        CacheCorruptError,
        CacheLockedError,
        CacheMismatchError,
        ChunkCorruptError,
        ShardCacheError,
        StorageError,
        TokenizerFileError,
    )
    from shard_cache.examples import (
        Documents,
        EraShuffledExamples,
        PermutedExamples,
        TokenWindows,
        process_slice,
    )
    from shard_cache.formats import RECORD_FORMATS, record_processor
    from shard_cache.fs import get_fs, join, read_bytes, write_atomic
    from shard_cache.inputs import expand_inputs
    from shard_cache.ledger import SETTINGS_NAME
    from shard_cache.mixture import (
        ExampleSource,
        MixtureExamples,
        MixtureExhaustedError,
        example_source,
        mixture_examples,
    )
    from shard_cache.mixture_layout import MixtureLayout
    from shard_cache.mixture_schedule import (
        MixtureConfigError,
        MixtureSchedule,
        parse_block_size,
        parse_stop_strategy,
        parse_train_weights,
    )
    from shard_cache.opening import open_cache
    from shard_cache.packing import PackedSequences, PackingStats, plan_packs
    from shard_cache.preference_records import (
        PREFERENCE_FORMATS,
        PreferenceChatProcessor,
        PreferenceProcessor,
        preference_processor,
    )
    from shard_cache.preferences import PreferencePairs
    from shard_cache.processor import BatchProcessor, TokenizerProcessor, load_tokenizer
    from shard_cache.progress import BuildMetrics
    from shard_cache.prompt_records import PromptProcessor, PromptRecords, prompt_settings_digest
    from shard_cache.ray_runtime import RayCluster, ensure_ray, find_coordinator_host, start_ray_cluster
    from shard_cache.reader import CacheReader
    from shard_cache.records import BadRecord, LossSpans, PromptCompletionProcessor, RecordProcessor, string_field
    from shard_cache.repair import RepairReport, repair_cache
    from shard_cache.shuffle import EraShuffle, FeistelPermutation
    from shard_cache.sources import DocumentReader
    from shard_cache.tokenizer_training import train_tokenizer
    from shard_cache.verify import VerifyReport, inspect_cache, verify_cache
