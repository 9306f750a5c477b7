"""The training and validation inputs a data config names: the built-in corpus, a dataset id, or URLs."""

from __future__ import annotations

from dataclasses import dataclass

import shard_cache

from lm_train.config.data_config import DataConfig
from lm_train.data.corpus import split_stdlib
from lm_train.errors import DataError


@dataclass(frozen=True)
class Inputs:
    """Input URLs of each split, and the format shard-cache reads them in (`text`, `hf` or `auto`)."""

    train: list[str]
    validation: list[str]
    fmt: str


def resolve_inputs(config: DataConfig) -> Inputs:
    """Expand the config's sources into input files; a source that matches nothing is a clear error."""
    if config.prebuilt:
        raise DataError(
            "data names no source of text (it trains on the prebuilt caches in data.cache_dir), and this command "
            "reads the documents themselves: give data.train_urls / data.validation_urls, data.id or data.builtin."
        )
    if config.builtin == "python_stdlib":
        split = split_stdlib(config.validation_fraction)
        return Inputs([str(p) for p in split.train], [str(p) for p in split.validation], "text")
    if config.id is not None:
        return Inputs([config.id], [], "hf")
    train = expand_urls(config.train_urls, "data.train_urls")
    validation = expand_urls(config.validation_urls, "data.validation_urls") if config.validation_urls else []
    return Inputs(train, validation, "auto")


def expand_urls(urls: tuple[str, ...], key: str) -> list[str]:
    """The files that `urls` name (globs and ranges expanded); a key that matches nothing is a clear error."""
    try:
        files = shard_cache.expand_inputs(list(urls))
    except shard_cache.ShardCacheError as e:
        raise DataError(f"{key}: {e}") from None
    if not files:
        raise DataError(f"{key}: {list(urls)} matches no file. Check the paths (globs and {{1..N}} ranges work).")
    return files
