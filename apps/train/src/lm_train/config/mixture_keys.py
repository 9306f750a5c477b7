"""The checks of a mixture's keys (`data.configs`, `data.train_weights`, ...), with key paths.

The weights, block size and stop strategy are checked by shard-cache's own parsers, so a config gets the same
rules and messages as the sampler that uses it; this module adds the key paths and the app's error type.
"""

from __future__ import annotations

import re

import shard_cache
from lm_train.config.data_config import DataConfig
from lm_train.config.mixture_config import check_source
from lm_train.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


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
    own = data.configs[name].shuffle
    return data.shuffle if own is None else own
