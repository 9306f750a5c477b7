"""A mixture's sources (`data.configs`, Levanter's key) and the checks of the mixture keys, with key paths.

The weights, block size and stop strategy are checked by shard-cache's own parsers, so a config gets the same
rules and messages as the sampler that uses it; this module adds the key paths and the app's error type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import shard_cache
from lm_train.errors import ConfigError

if TYPE_CHECKING:
    from lm_train.config.data_config import DataConfig

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture: its own documents (URLs, a dataset id or the built-in corpus) and cache."""

    train_urls: tuple[str, ...] = ()
    """Paths or fsspec URLs (globs and {1..N} ranges) of this source's training documents."""
    validation_urls: tuple[str, ...] = ()
    """This source's validation documents; with `builtin`, empty means a held-out split of its files."""
    id: str | None = None
    """A Hugging Face dataset id or local dataset path (needs the shard-cache `hf` extra)."""
    builtin: str | None = None
    """`python_stdlib`: files of the Python standard library, optionally narrowed by `packages`."""
    packages: tuple[str, ...] = ()
    """With `builtin`: only these top-level packages or modules of the standard library (e.g. [email, asyncio])."""
    exclude_packages: tuple[str, ...] = ()
    """With `builtin`: every file except those of these top-level packages or modules."""
    cache_dir: str | None = None
    """This source's cache; default: <data.cache_dir>/<name>."""
    text_key: str | None = None
    """The record field holding the text; default: data.text_key."""
    shuffle: bool | int | None = None
    """As data.shuffle, for this source alone; default: data.shuffle."""


def check_source_names(data: DataConfig) -> None:
    """Source names become metric keys (`eval/<name>/loss`) and folder names: letters, digits, `_`, `-`, `.`."""
    for name in data.configs:
        if not _NAME.match(str(name)):
            raise ConfigError(
                f"data.configs.{name}: a source name is used in metric keys and folder names; use letters, digits, "
                "`_`, `-` or `.` (starting with a letter or digit), e.g. `web` or `code_v2`."
            )


def check_source(name: str, source: SourceConfig) -> None:
    """Exactly one kind of input per source, and the built-in filters only with the built-in corpus."""
    key = f"data.configs.{name}"
    given = [k for k, v in (("train_urls", source.train_urls), ("id", source.id), ("builtin", source.builtin)) if v]
    if len(given) != 1:
        raise ConfigError(
            f"{key}: give this source exactly one of `train_urls`, `id` or `builtin: python_stdlib` (got "
            f"{', '.join(given) or 'none'})."
        )
    if source.builtin is not None and source.builtin != "python_stdlib":
        raise ConfigError(f"{key}.builtin: unknown corpus {source.builtin!r}; the built-in corpus is `python_stdlib`.")
    if (source.packages or source.exclude_packages) and source.builtin is None:
        raise ConfigError(
            f"{key}: `packages` and `exclude_packages` narrow `builtin: python_stdlib`; set it or drop them."
        )
    if source.packages and source.exclude_packages:
        raise ConfigError(f"{key}: give `packages` (only these) or `exclude_packages` (all but these), not both.")
    if source.validation_urls and source.id is not None:
        raise ConfigError(f"{key}: `validation_urls` go with `train_urls`; a dataset `id` has no validation URLs.")


def mixture_schedule(data: DataConfig) -> shard_cache.MixtureSchedule:
    """The checked weight schedule of a mixture config; every mixture key is checked, errors name the key."""
    if not data.configs:
        raise ConfigError(
            "data.configs is empty: a mixture needs at least one source, e.g. {web: {train_urls: [...]}}."
        )
    check_source_names(data)
    for name, source in data.configs.items():
        check_source(name, source)
    try:
        block_size = shard_cache.parse_block_size(data.mixture_block_size, key="data.mixture_block_size")
        shard_cache.parse_stop_strategy(data.stop_strategy, key="data.stop_strategy")
        # A positive weight too small for one example per block is warned about by the parser.
        return shard_cache.parse_train_weights(
            data.train_weights, list(data.configs), key="data.train_weights", block_size=block_size
        )
    except shard_cache.MixtureConfigError as e:
        raise ConfigError(str(e)) from None


def source_shuffle(data: DataConfig, name: str) -> bool | int:
    """The shuffle a source uses: its own, else data.shuffle."""
    own = data.configs[name].shuffle
    return data.shuffle if own is None else own
