"""The run's tokenizer: the configured one, or a byte-level BPE trained on the training split on first use.

Every path here may be a local path or a gs:// / s3:// URL (read through fsspec, as shard-cache reads them).
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path
from typing import cast

import shard_cache
from lm_train.config.data_config import DataConfig
from lm_train.data import DATA_TIMEOUT_S
from lm_train.data.inputs import Inputs
from lm_train.errors import DataError
from shard_cache import get_fs

# "gpt2" or "org/name", as the Hub spells a repository; a name ending in .json is a missing file instead.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def exists(url: str) -> bool:
    """Whether a file exists at a local path or a gs:// / s3:// URL."""
    fs, path = get_fs(url)
    return fs.exists(path)


def tokenizer_json(path: str) -> str:
    """The tokenizer.json of a tokenizer given as a file or as a Hugging Face tokenizer directory."""
    fs, fs_path = get_fs(str(path))
    return f"{str(path).rstrip('/')}/tokenizer.json" if fs.isdir(fs_path) else str(path)


def tokenizer_bytes(path: str) -> bytes:
    """The content of a tokenizer's tokenizer.json (file, directory or URL)."""
    fs, fs_path = get_fs(tokenizer_json(path))
    return cast(bytes, fs.cat_file(fs_path))  # fsspec reads whole files as bytes; its code does not say so


def trained_tokenizer_path(config: DataConfig) -> str:
    """Where the BPE trained for a config lives: beside the caches, named by its vocabulary size."""
    return f"{config.cache_dir.rstrip('/')}/tokenizer-bpe{config.vocab_size}.json"


def _tokenizer_name(config: DataConfig) -> str:
    if not config.tokenizer:
        raise DataError(
            "data.tokenizer is empty where a given tokenizer is needed: set it to a tokenizer.json file or a Hugging "
            "Face tokenizer directory."
        )
    return config.tokenizer


def configured_tokenizer_path(config: DataConfig) -> str:
    """`data.tokenizer` as a path (user directory expanded) or URL, unchecked."""
    name = _tokenizer_name(config)
    return name if "://" in name else str(Path(name).expanduser())


def looks_like_hub_id(name: str) -> bool:
    """Whether a tokenizer that is not on disk is named as a Hugging Face Hub repository (`gpt2`, `org/name`)."""
    return bool(_HUB_ID.match(name)) and ".." not in name and not name.lower().endswith(".json")


def _hub_id_error(name: str) -> DataError:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        why = "HF_HUB_OFFLINE is set here"
    elif importlib.util.find_spec("huggingface_hub") is None:
        why = "this machine has no Hub client: hf-bridge's `hub` extra is not installed"
    else:
        why = "training machines often have no network, and a run must read the same files on every process"
    return DataError(
        f"data.tokenizer: {name!r} is not a file or folder here, and looks like a Hugging Face Hub id (as Levanter's "
        f"configs name tokenizers); lm-train downloads nothing from the Hub ({why}). Fetch it where the Hub is "
        f"reachable, e.g. `hf download {name} tokenizer.json tokenizer_config.json --local-dir tokenizers/{name}` "
        f"(`pip install 'hf-bridge[hub]'` brings `hf`), copy that folder here, and set data.tokenizer to it (an HF "
        "tokenizer directory) or to its tokenizer.json."
    )


def configured_tokenizer(config: DataConfig) -> str:
    """`data.tokenizer`, checked to exist."""
    path = configured_tokenizer_path(config)
    if not exists(path):
        name = _tokenizer_name(config)
        if "://" not in name and looks_like_hub_id(name):
            raise _hub_id_error(name)
        raise DataError(
            f"data.tokenizer: {config.tokenizer} does not exist. Give a tokenizer.json file or a Hugging Face "
            "tokenizer directory (a path or a gs:// / s3:// URL), or leave data.tokenizer empty to train a "
            "byte-level BPE on the training data."
        )
    return path


def provide_tokenizer(config: DataConfig, inputs: Inputs, *, progress: bool) -> str:
    """The configured tokenizer, or the cached trained one, training it first if needed (the building process)."""
    if config.tokenizer:
        return configured_tokenizer(config)
    cached = trained_tokenizer_path(config)
    if exists(cached):
        return cached
    if inputs.fmt != "text":
        raise DataError(
            "data.tokenizer is empty, and a tokenizer can be trained on first use only for the built-in corpus. "
            "Set data.tokenizer to a tokenizer.json (shard-cache's train_tokenizer can make one)."
        )
    if "://" not in cached:
        Path(cached).parent.mkdir(parents=True, exist_ok=True)
    # shard-cache writes it atomically with its sha256 beside it (checked on every load): a run killed while
    # training leaves no half-written tokenizer, and a damaged one is refused rather than tokenized with.
    try:
        shard_cache.train_tokenizer(
            [Path(p) for p in inputs.train], config.vocab_size, save_path=cached, show_progress=progress
        )
    except shard_cache.StorageError as e:
        raise DataError(
            f"{str(e).rstrip('.')}. (data.tokenizer is empty, so the run trains one into data.cache_dir "
            f"{config.cache_dir}: free space there, set data.cache_dir to a directory with room, or set data.tokenizer "
            "to a tokenizer.json. No part of it was left behind: it is written whole or not at all.)"
        ) from None
    return cached


def wait_for_tokenizer(config: DataConfig, timeout: float = DATA_TIMEOUT_S) -> str:
    """The tokenizer that the building process provides (processes other than the builder call this)."""
    if config.tokenizer:
        return configured_tokenizer(config)
    path = trained_tokenizer_path(config)
    deadline = time.monotonic() + timeout
    while not exists(path):
        if time.monotonic() > deadline:
            raise DataError(
                f"Waited {timeout:.0f} s for process 0 to train the tokenizer at {path}. data.cache_dir must be a "
                "directory that every process sees (a shared file system or a gs:// / s3:// URL)."
            )
        time.sleep(0.5)
    return path
