"""A mixture's caches: one tokenizer, and per source a train and a validation cache, all built in the background.

Every source's builds start at once on the same Ray cluster; training then waits only for what its first steps
read. A source's cache lives under its own `cache_dir` (default `<data.cache_dir>/<name>`), in a folder named
by the tokenizer, as for a single source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import shard_cache
from shard_cache import BuildHandle

from lm_train.config.data_config import DataConfig
from lm_train.config.mixture_config import SourceConfig
from lm_train.config.mixture_keys import mixture_schedule
from lm_train.data.build_metrics import MixtureBuildMetrics
from lm_train.data.caches import PreparedData, cache_tag, prepare_data
from lm_train.data.corpus import split_stdlib, stdlib_root
from lm_train.data.inputs import Inputs, expand_urls
from lm_train.data.tokenizer import provide_tokenizer, wait_for_tokenizer
from lm_train.errors import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceCaches:
    """Where one source's caches live (validation: None when it has no validation data)."""

    train: str
    validation: str | None


@dataclass
class MixtureData:
    """The tokenizer and every source's caches, possibly still being built."""

    tokenizer_path: str
    sources: dict[str, SourceCaches]
    """By source name, sorted."""
    builds: list[BuildHandle]
    build_metrics: MixtureBuildMetrics | None = None
    """The train caches' build counts, per source, while they build in the background (None when none does)."""

    def tokenizer(self):
        return shard_cache.load_tokenizer(self.tokenizer_path)

    def vocab_size(self) -> int:
        return self.tokenizer().get_vocab_size(with_added_tokens=True)

    def wait(self) -> None:
        """Block until every cache build has finished (raising its error, if any)."""
        for handle in self.builds:
            handle.wait()

    def stop_builds(self) -> None:
        """Stop the builds still running, keeping what they committed (a later run resumes them)."""
        for handle in self.builds:
            try:
                handle.stop()
            except TimeoutError as e:  # on the way out: report, do not mask what ended the run
                logger.warning("%s; it may still be writing under one of: %s", e, self.describe())

    def check_builds(self) -> None:
        """Raise the error of a background build that has failed."""
        for handle in self.builds:
            if handle.done():
                handle.wait()

    def describe(self) -> str:
        parts = [f"tokenizer {self.tokenizer_path}"]
        for name, caches in self.sources.items():
            parts.append(f"{name}: train {caches.train}" + (f", validation {caches.validation}" if caches.validation else ""))
        return "; ".join(parts)


def _top_level(relative: str) -> str:
    """The package or module a standard-library file belongs to: `email/mime/text.py` -> email, `os.py` -> os."""
    first = relative.split("/", 1)[0]
    return first[:-3] if first.endswith(".py") else first


def _builtin_inputs(name: str, source: SourceConfig, validation_fraction: float) -> Inputs:
    root = stdlib_root()
    split = split_stdlib(validation_fraction)
    wanted, dropped = set(source.packages), set(source.exclude_packages)

    def keep(path) -> bool:
        package = _top_level(path.relative_to(root).as_posix())
        return (not wanted or package in wanted) and package not in dropped

    train = [str(p) for p in split.train if keep(p)]
    validation = [str(p) for p in split.validation if keep(p)]
    if source.validation_urls:
        validation = expand_urls(source.validation_urls, f"data.configs.{name}.validation_urls")
    if not train:
        raise DataError(
            f"data.configs.{name}: the standard library at {root} has no training file in packages "
            f"{sorted(wanted) or 'all'} (excluding {sorted(dropped) or 'none'}). Check the package names "
            "(top-level folders or modules, e.g. email, asyncio, json)."
        )
    return Inputs(train, validation, "text")


def source_inputs(data: DataConfig, name: str) -> Inputs:
    """The input files of one source of a mixture; a source that matches nothing is a clear error."""
    source = data.configs[name]
    if source.builtin is not None:
        return _builtin_inputs(name, source, data.validation_fraction)
    if source.id is not None:
        return Inputs([source.id], [], "hf")
    key = f"data.configs.{name}"
    train = expand_urls(source.train_urls, f"{key}.train_urls")
    validation = expand_urls(source.validation_urls, f"{key}.validation_urls") if source.validation_urls else []
    return Inputs(train, validation, "auto")


def source_cache_root(data: DataConfig, name: str) -> str:
    """A source's cache directory: its own `cache_dir`, else <data.cache_dir>/<name>."""
    own = data.configs[name].cache_dir
    return (own or f"{data.cache_dir.rstrip('/')}/{name}").rstrip("/")


def _tokenizer_inputs(all_inputs: dict[str, Inputs]) -> Inputs:
    """Every source's training files, for a tokenizer trained on first use (text files only)."""
    files = sorted({f for inputs in all_inputs.values() for f in inputs.train})
    fmt = "text" if all(inputs.fmt == "text" for inputs in all_inputs.values()) else "auto"
    return Inputs(files, [], fmt)


def prepare_mixture_data(
    config: DataConfig, *, background: bool = True, progress: Any = True, builder: bool = True
) -> MixtureData:
    """Find or train the tokenizer, then find, resume or start every source's cache builds.

    As for one source, only the `builder` process builds; the others read what it writes.
    """
    mixture_schedule(config)  # the mixture's keys, checked before anything is read
    inputs = {name: source_inputs(config, name) for name in sorted(config.configs)}
    if builder:
        tokenizer_path = provide_tokenizer(config, _tokenizer_inputs(inputs), progress=bool(progress))
    else:
        tokenizer_path = wait_for_tokenizer(config)
    tag = cache_tag(tokenizer_path, config)
    sources = {}
    for name, source_input in inputs.items():
        base = f"{source_cache_root(config, name)}/{tag}"
        sources[name] = SourceCaches(f"{base}/train", f"{base}/validation" if source_input.validation else None)
    data = MixtureData(tokenizer_path, sources, [])
    if not builder:
        return data
    processor = shard_cache.TokenizerProcessor(tokenizer_path, enforce_eos=config.enforce_eos)
    building = [name for name in inputs if background and not _finished(sources[name].train)]
    watched = MixtureBuildMetrics(building) if building else None
    for name, source_input in inputs.items():
        options: dict[str, Any] = dict(
            processor=processor,
            files_per_shard=max(1, len(source_input.train) // 64) if source_input.fmt == "text" else 1,
            fmt=source_input.fmt,
            text_field=config.configs[name].text_key or config.text_key,
            chunk_size=config.chunk_size,
            num_workers=config.num_workers,
            progress=progress,
        )
        jobs = [(source_input.validation, sources[name].validation, None)] if source_input.validation else []
        train_callback = watched.sources[name] if watched is not None and name in building else None
        jobs.append((source_input.train, sources[name].train, train_callback))
        for files, cache_dir, callback in jobs:
            # A finished cache is only checked against these settings (no Ray start); others are built or resumed.
            if background and not _finished(cache_dir):
                data.builds.append(shard_cache.start_build(files, cache_dir, metrics_callback=callback, **options))
            else:
                shard_cache.build_cache(files, cache_dir, **options)
    data.build_metrics = watched
    return data


def _finished(cache_dir: str) -> bool:
    try:
        return shard_cache.open_cache(cache_dir, timeout=0.0).finished
    except (FileNotFoundError, TimeoutError, shard_cache.ShardCacheError):
        return False


def prepare_any_data(
    config: DataConfig, *, background: bool = True, progress: Any = True, builder: bool = True
) -> PreparedData | MixtureData:
    """The caches of a run: a mixture's sources, or the single source of `prepare_data`."""
    if config.is_mixture:
        return prepare_mixture_data(config, background=background, progress=progress, builder=builder)
    return prepare_data(config, background=background, progress=progress, builder=builder)
