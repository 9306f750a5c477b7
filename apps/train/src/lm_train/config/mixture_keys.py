"""The run's sources as one mixture (a single source is a mixture of one), and the checks of a mixture's keys.

The weights, block size and stop strategy are checked by shard-cache's own parsers, so a config gets the same
rules and messages as the sampler that uses it; this module adds the key paths and the app's error type.
"""

from __future__ import annotations

import re

import shard_cache
from lm_train.config.data_config import DataConfig
from lm_train.config.data_formats import TextFormat
from lm_train.config.mixture_config import SourceConfig, check_source
from lm_train.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")

SINGLE_SOURCE = "train"
"""The name of the only source of a run whose data names no mixture (it appears in no metric key)."""


def data_sources(data: DataConfig) -> dict[str, SourceConfig]:
    """The run's sources by name, sorted: a mixture's `data.configs`, or the single source of `data.train_urls`,
    `data.id` or `data.builtin` as a mixture of one (its cache directly under data.cache_dir)."""
    if data.is_mixture:
        return dict(sorted(data.configs.items()))
    own_key = data.format.text_key if isinstance(data.format, TextFormat) else None
    # The built-in corpus of a single source always validates on its held-out split.
    validation = () if data.builtin is not None else data.validation_urls
    single = SourceConfig(
        data.train_urls, validation, data.id, data.builtin, cache_dir=data.cache_dir, text_key=own_key or data.text_key
    )
    return {SINGLE_SOURCE: single}


def source_key(data: DataConfig, name: str) -> str:
    """The key path of a source's settings in errors: `data` for a single source, else `data.configs.<name>`."""
    return f"data.configs.{name}" if data.is_mixture else "data"


def data_schedule(data: DataConfig) -> shard_cache.MixtureSchedule:
    """The run's weight schedule: a mixture's (checked), or weight 1 on a single source at every step."""
    if data.is_mixture:
        return mixture_schedule(data)
    return shard_cache.parse_train_weights(None, [SINGLE_SOURCE], key="data.train_weights")


def check_source_names(data: DataConfig) -> None:
    """Source names become metric keys (`eval/<name>/loss`) and folder names: letters, digits, `_`, `-`, `.`."""
    for name in data.configs:
        if not _NAME.match(str(name)):
            raise ConfigError(
                f"data.configs.{name}: a source name is used in metric keys and folder names; use letters, digits, "
                "`_`, `-` or `.` (starting with a letter or digit), e.g. `web` or `code_v2`."
            )


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
    own = data_sources(data)[name].shuffle
    return data.shuffle if own is None else own
