"""The run's tokenizer and caches, one train and one validation cache per source (a single source is a mixture of
one): found finished, resumed, or built in the background while training starts.

Every source's builds start at once on the same Ray cluster; training then waits only for what its first steps
read. A source's cache lives under its own root (a single source's: data.cache_dir; a mixture's: its `cache_dir`,
default `<data.cache_dir>/<name>`), in a folder named by the tokenizer and the record format.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import shard_cache
from lm_train.config.data_config import DataConfig
from lm_train.config.mixture_keys import SINGLE_SOURCE, data_schedule, data_sources
from lm_train.data.build_metrics import LatestBuildMetrics, MixtureBuildMetrics
from lm_train.data.inputs import Inputs, source_inputs
from lm_train.data.record_formats import format_tag, processor_for
from lm_train.data.tokenizer import configured_tokenizer, provide_tokenizer, tokenizer_bytes, wait_for_tokenizer
from lm_train.errors import DataError
from shard_cache import SETTINGS_NAME, BuildHandle, get_fs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceCaches:
    """Where one source's caches live (validation: None when it has no validation data)."""

    train: str
    validation: str | None


@dataclass
class PreparedData:
    """The tokenizer and every source's caches, possibly still being built.

    `PreparedData(tokenizer, train_cache, validation_cache, builds)` is the data of a single source; a mixture's
    sources are given as `sources` instead.
    """

    tokenizer_path: str
    train_cache: str | None = None
    """The single source's train cache (None for a mixture: see `sources`)."""
    validation_cache: str | None = None
    builds: list[BuildHandle] = field(default_factory=list)
    build_metrics: LatestBuildMetrics | MixtureBuildMetrics | None = None
    """The train caches' build counts while they build in the background (None when none does)."""
    sources: dict[str, SourceCaches] = field(default_factory=dict)
    """By source name, sorted (a single source's is named `SINGLE_SOURCE`; made from train_cache if not given)."""

    def __post_init__(self) -> None:
        if not self.sources and self.train_cache is not None:
            self.sources = {SINGLE_SOURCE: SourceCaches(self.train_cache, self.validation_cache)}

    def tokenizer(self):
        return shard_cache.load_tokenizer(self.tokenizer_path)

    def vocab_size(self) -> int:
        return self.tokenizer().get_vocab_size(with_added_tokens=True)

    def train_caches_finished(self) -> bool:
        """Whether every train cache is complete (read from its ledger: any process can tell)."""
        return all(_finished(source.train) for source in self.sources.values())

    def wait(self) -> None:
        """Block until every cache build has finished (raising its error, if any)."""
        for handle in self.builds:
            handle.wait()

    def stop_builds(self) -> None:
        """Stop the background builds still running, keeping what they committed (a later run resumes them)."""
        for handle in self.builds:
            try:
                handle.stop()
            except TimeoutError as e:  # called on the way out: report, do not mask what ended the run
                logger.warning("%s; it may still be writing under one of: %s", e, self.describe())

    def check_builds(self) -> None:
        """Raise the error of a background build that has failed."""
        for handle in self.builds:
            if handle.done():
                handle.wait()

    def describe(self) -> str:
        if self.train_cache is not None:  # a single source
            parts = [f"tokenizer {self.tokenizer_path}", f"train {self.train_cache}"]
            return ", ".join(parts + ([f"validation {self.validation_cache}"] if self.validation_cache else []))
        parts = [f"tokenizer {self.tokenizer_path}"]
        for name, caches in self.sources.items():
            parts.append(
                f"{name}: train {caches.train}" + (f", validation {caches.validation}" if caches.validation else "")
            )
        return "; ".join(parts)


def cache_tag(tokenizer_path: str, config: DataConfig, processor: Any = None) -> str:
    """The cache folder's name: the tokenizer's content (another tokenizer never reuses stale tokens), the
    cache format (`sc4`: shard-cache 0.4's round-robin file order, so that a cache of 0.3's grouped files, which
    0.4 refuses, is not reused) and the settings that change the tokens (the record format's, when `processor`
    is given: plain text caches keep the folder they always had)."""
    tag = "tok-" + hashlib.sha256(tokenizer_bytes(tokenizer_path)).hexdigest()[:12] + "-sc4"
    tag = tag if config.enforce_eos else tag + "-own-special-tokens"
    return tag + (format_tag(config, processor) if processor is not None else "")


def source_cache_root(data: DataConfig, name: str) -> str:
    """A source's cache directory: its own `cache_dir`, else <data.cache_dir>/<name>."""
    own = data_sources(data)[name].cache_dir
    return (own or f"{data.cache_dir.rstrip('/')}/{name}").rstrip("/")


def _tokenizer_inputs(config: DataConfig, all_inputs: dict[str, Inputs]) -> Inputs:
    """The training files a tokenizer trained on first use reads (text files only): a single source's as they
    are, else every source's, sorted."""
    if not config.is_mixture:
        return all_inputs[SINGLE_SOURCE]
    files = sorted({f for inputs in all_inputs.values() for f in inputs.train})
    fmt = "text" if all(inputs.fmt == "text" for inputs in all_inputs.values()) else "auto"
    return Inputs(files, [], fmt)


def prepare_data(
    config: DataConfig,
    *,
    background: bool = True,
    progress: Any = True,
    metrics_callback: Callable[[Any], None] | None = None,
    builder: bool = True,
) -> PreparedData:
    """Find or train the tokenizer, then find, resume or start every source's cache builds (in the background if
    asked). `metrics_callback`: a single source's train build counts go there instead of `build_metrics`.

    In a multi-process run only one process is the `builder`; the others wait for the tokenizer it trains and
    read the caches it writes (cache_dir must then be storage that every process sees).
    """
    if config.prebuilt:
        return prebuilt_data(config)
    data_schedule(config)  # a mixture's keys, checked before anything is read
    inputs = {name: source_inputs(config, name) for name in data_sources(config)}
    if builder:
        tokenizer_path = provide_tokenizer(config, _tokenizer_inputs(config, inputs), progress=bool(progress))
    else:
        tokenizer_path = wait_for_tokenizer(config)
    processor = processor_for(config, tokenizer_path)
    tag = cache_tag(tokenizer_path, config, processor)
    sources = {}
    for name, source_input in inputs.items():
        base = f"{source_cache_root(config, name)}/{tag}"
        sources[name] = SourceCaches(f"{base}/train", f"{base}/validation" if source_input.validation else None)
    single = sources.get(SINGLE_SOURCE) if not config.is_mixture else None
    train, validation = (single.train, single.validation) if single else (None, None)
    data = PreparedData(tokenizer_path, train, validation, sources=sources)
    if not builder:
        return data
    building = [name for name in inputs if background and not _finished(sources[name].train)]
    watched = _build_metrics(config, building) if metrics_callback is None else None
    for name, source_input in inputs.items():
        source = data_sources(config)[name]
        options: dict[str, Any] = dict(
            processor=processor,
            # Hundreds of small files make better work units when grouped: a Ray task per ~1/64 of the corpus.
            files_per_shard=max(1, len(source_input.train) // 64) if source_input.fmt == "text" else 1,
            fmt=source_input.fmt,
            text_field=source.text_key or config.text_key,
            on_bad_input=config.on_bad_input,
            chunk_size=config.chunk_size,
            num_workers=config.num_workers,
            in_process=config.build_in_process,
            progress=progress,
        )
        jobs: list[tuple[list[str], str, Callable[[Any], None] | None]] = []
        if source_input.validation:
            validation_cache = sources[name].validation
            assert validation_cache is not None  # made above for every source with validation data
            jobs.append((source_input.validation, validation_cache, None))
        watcher = watched.for_source(name) if watched is not None else None
        jobs.append((source_input.train, sources[name].train, metrics_callback or watcher))
        for files, cache_dir, callback in jobs:
            # A finished cache is only checked against these settings (no Ray start); others are built or resumed.
            if background and not _finished(cache_dir):
                data.builds.append(shard_cache.start_build(files, cache_dir, metrics_callback=callback, **options))
            else:
                shard_cache.build_cache(files, cache_dir, metrics_callback=callback, **options)
    data.build_metrics = watched
    return data


prepare_any_data = prepare_data
"""The caches of a run, a mixture's sources or a single source's (the name the run and the CLI import)."""


def _build_metrics(config: DataConfig, building: list[str]) -> LatestBuildMetrics | MixtureBuildMetrics | None:
    """What watches the train builds that run in the background: a single source's counts are logged as
    `preprocessing/<key>`, a mixture's per source (None when nothing builds)."""
    if not building:
        return None
    return MixtureBuildMetrics(building) if config.is_mixture else LatestBuildMetrics()


def _finished(cache_dir: str) -> bool:
    """Whether a cache's build has completed (False if it does not exist yet or is partial)."""
    try:
        return shard_cache.open_cache(cache_dir, timeout=0.0).finished
    except (FileNotFoundError, TimeoutError, shard_cache.ShardCacheError):
        return False


def prebuilt_data(config: DataConfig) -> PreparedData:
    """The finished caches under data.cache_dir (train/, and validation/ where there is one), built before with
    the configured tokenizer and format: checked, never built or changed."""
    tokenizer_path = configured_tokenizer(config)
    fingerprint = processor_for(config, tokenizer_path).fingerprint()
    root = config.cache_dir.rstrip("/")
    train, validation = f"{root}/train", f"{root}/validation"
    _check_prebuilt(train, fingerprint, config)
    has_validation = get_fs(validation)[0].exists(get_fs(validation)[1])
    if has_validation:
        _check_prebuilt(validation, fingerprint, config)
    return PreparedData(tokenizer_path, train, validation if has_validation else None, [])


def _check_prebuilt(cache: str, fingerprint: dict[str, Any], config: DataConfig) -> None:
    if not _finished(cache):
        raise DataError(
            f"data.cache_dir: {cache} holds no finished cache, and the data section names no source of text to "
            "build one from. Point data.cache_dir at the folder whose train/ a finished build wrote (for a cache "
            "lm-train built: <cache_dir>/tok-...), or give data.train_urls, data.id or data.builtin."
        )
    fs, path = get_fs(f"{cache}/{SETTINGS_NAME}")
    built_with = json.loads(fs.cat_file(path)).get("processor") or {}
    if built_with != fingerprint:
        differing = sorted(k for k in set(built_with) | set(fingerprint) if built_with.get(k) != fingerprint.get(k))
        changes = "; ".join(f"{k}: built {built_with.get(k)!r}, here {fingerprint.get(k)!r}" for k in differing)
        raise DataError(
            f"{cache} was tokenized with other settings than this config's ({changes}). Set data.tokenizer, "
            "data.format and data.enforce_eos to what the cache was built with, or give the source text to build "
            "a cache for these settings."
        )
