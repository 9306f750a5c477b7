"""The training and validation inputs of each source of the run: the built-in corpus, a dataset id, or URLs."""

from __future__ import annotations

from dataclasses import dataclass

import shard_cache

from lm_train.config.data_config import DataConfig
from lm_train.config.mixture_config import SourceConfig
from lm_train.config.mixture_keys import SINGLE_SOURCE, data_sources, source_key
from lm_train.data.corpus import split_stdlib, stdlib_root
from lm_train.errors import DataError


@dataclass(frozen=True)
class Inputs:
    """Input URLs of each split, and the format shard-cache reads them in (`text`, `hf` or `auto`)."""

    train: list[str]
    validation: list[str]
    fmt: str


def resolve_inputs(config: DataConfig) -> Inputs:
    """The input files of a single-source config; a source that matches nothing is a clear error."""
    if config.prebuilt:
        raise DataError(
            "data names no source of text (it trains on the prebuilt caches in data.cache_dir), and this command "
            "reads the documents themselves: give data.train_urls / data.validation_urls, data.id or data.builtin."
        )
    return source_inputs(config, SINGLE_SOURCE)


def source_inputs(data: DataConfig, name: str) -> Inputs:
    """The input files of one source of the run; a source that matches nothing is a clear error."""
    source, key = data_sources(data)[name], source_key(data, name)
    if source.builtin is not None:
        return _builtin_inputs(key, source, data.validation_fraction)
    if source.id is not None:
        return Inputs([source.id], [], "hf")
    train = expand_urls(source.train_urls, f"{key}.train_urls")
    validation = expand_urls(source.validation_urls, f"{key}.validation_urls") if source.validation_urls else []
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


def _top_level(relative: str) -> str:
    """The package or module a standard-library file belongs to: `email/mime/text.py` -> email, `os.py` -> os."""
    first = relative.split("/", 1)[0]
    return first[:-3] if first.endswith(".py") else first


def _builtin_inputs(key: str, source: SourceConfig, validation_fraction: float) -> Inputs:
    root = stdlib_root()
    split = split_stdlib(validation_fraction)
    wanted, dropped = set(source.packages), set(source.exclude_packages)

    def keep(path) -> bool:
        package = _top_level(path.relative_to(root).as_posix())
        return (not wanted or package in wanted) and package not in dropped

    train = [str(p) for p in split.train if keep(p)]
    validation = [str(p) for p in split.validation if keep(p)]
    if source.validation_urls:
        validation = expand_urls(source.validation_urls, f"{key}.validation_urls")
    if not train:
        raise DataError(
            f"{key}: the standard library at {root} has no training file in packages "
            f"{sorted(wanted) or 'all'} (excluding {sorted(dropped) or 'none'}). Check the package names "
            "(top-level folders or modules, e.g. email, asyncio, json)."
        )
    return Inputs(train, validation, "text")
