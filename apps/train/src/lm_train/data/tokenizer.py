"""The run's tokenizer: the configured one, or a byte-level BPE trained on the training split on first use."""

from __future__ import annotations

import time
from pathlib import Path

import shard_cache

from lm_train.config.data_config import DataConfig
from lm_train.data import DATA_TIMEOUT_S
from lm_train.data.inputs import Inputs
from lm_train.errors import DataError


def tokenizer_json(path: str) -> Path:
    """The tokenizer.json of a tokenizer given as a file or as a Hugging Face tokenizer directory."""
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def trained_tokenizer_path(config: DataConfig) -> Path:
    """Where the BPE trained for a config lives: beside the caches, named by its vocabulary size."""
    return Path(config.cache_dir) / f"tokenizer-bpe{config.vocab_size}.json"


def configured_tokenizer(config: DataConfig) -> str:
    """`data.tokenizer`, checked to exist."""
    path = Path(config.tokenizer).expanduser()
    if not path.exists():
        raise DataError(
            f"data.tokenizer: {config.tokenizer} does not exist. Give a tokenizer.json file or a Hugging Face "
            "tokenizer directory, or leave data.tokenizer empty to train a byte-level BPE on the training data."
        )
    return str(path)


def provide_tokenizer(config: DataConfig, inputs: Inputs, *, progress: bool) -> str:
    """The configured tokenizer, or the cached trained one, training it first if needed (the building process)."""
    if config.tokenizer:
        return configured_tokenizer(config)
    cached = trained_tokenizer_path(config)
    if cached.exists():
        return str(cached)
    if inputs.fmt != "text":
        raise DataError(
            "data.tokenizer is empty, and a tokenizer can be trained on first use only for the built-in corpus. "
            "Set data.tokenizer to a tokenizer.json (shard-cache's train_tokenizer can make one)."
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    # train_tokenizer writes the file atomically (a run killed while training leaves none), then its sha256
    # beside it, which loading checks.
    shard_cache.train_tokenizer(
        [Path(p) for p in inputs.train], config.vocab_size, save_path=cached, show_progress=progress
    )
    return str(cached)


def wait_for_tokenizer(config: DataConfig, timeout: float = DATA_TIMEOUT_S) -> str:
    """The tokenizer that the building process provides (processes other than the builder call this)."""
    if config.tokenizer:
        return configured_tokenizer(config)
    path = trained_tokenizer_path(config)
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise DataError(
                f"Waited {timeout:.0f} s for process 0 to train the tokenizer at {path}. data.cache_dir must be a "
                "directory that every process sees (a shared file system or a gs:// / s3:// URL)."
            )
        time.sleep(0.5)
    return str(path)
