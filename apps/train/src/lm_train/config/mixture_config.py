"""A mixture's source (`data.configs.<name>`, Levanter's key) and its own checks, with key paths."""

from __future__ import annotations

from dataclasses import dataclass

from lm_train.errors import ConfigError


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
