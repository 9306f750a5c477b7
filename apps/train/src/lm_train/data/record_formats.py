"""The shard-cache processor that `data.format` names, and the part of the cache's folder name it sets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import shard_cache
from shard_cache import BatchProcessor

from lm_train.config.data_config import DataConfig
from lm_train.config.data_formats import ChatFormat, TextFormat
from lm_train.errors import ConfigError


def text_field(config: DataConfig) -> str:
    """The record field that holds a text document."""
    own = config.format.text_key if isinstance(config.format, TextFormat) else None
    return own or config.text_key


def processor_for(config: DataConfig, tokenizer_path: str) -> BatchProcessor:
    """The processor that turns this data's records into `input_ids` (and `loss_mask`, for chat and
    prompt/completion records): the one its `data.format` config builds."""
    return config.format.processor(tokenizer_path, enforce_eos=config.enforce_eos)


def format_tag(config: DataConfig, processor: BatchProcessor) -> str:
    """A suffix of the cache folder for settings that change what the cache holds ("" for plain text caches,
    so that they keep the folder they always had)."""
    if isinstance(config.format, TextFormat) and config.on_bad_input == "fail":
        return ""
    settings = {"processor": processor.fingerprint(), "on_bad_input": config.on_bad_input}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8")).hexdigest()[:10]
    return f"-{config.format_type}-{digest}"


def check_data_format(config: DataConfig) -> None:
    """Record-format settings that cannot work, as config errors, before any data is read.

    With a tokenizer given, the processor is built (its chat template found and compiled) here.
    """
    if config.format.has_loss_mask:
        kind = config.format_type
        if config.builtin is not None:
            raise ConfigError(
                f"data.format {kind} reads records (jsonl or parquet), but data.builtin is a corpus of plain text "
                "files. Give the records in data.train_urls (docs/sft-lora.md turns the built-in corpus into chats)."
            )
        if not config.tokenizer:
            raise ConfigError(
                f"data.format {kind} needs data.tokenizer: the tokenizer (an HF tokenizer directory, for its chat "
                "template and special tokens) of the model being tuned."
            )
    if not config.tokenizer or not Path(config.tokenizer).expanduser().exists():
        return  # no tokenizer to build a processor with yet (data.tokenizer's own check reports a missing one)
    try:
        processor_for(config, str(Path(config.tokenizer).expanduser()))
    except shard_cache.ShardCacheError as e:
        key = "data.format.chat_template" if isinstance(config.format, ChatFormat) else "data.tokenizer"
        raise ConfigError(f"{key}: {e}") from None
