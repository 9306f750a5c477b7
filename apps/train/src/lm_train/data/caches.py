"""The run's tokenized caches: found finished, resumed, or built in the background while training starts."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import shard_cache
from lm_train.config.data_config import DataConfig
from lm_train.data.build_metrics import LatestBuildMetrics
from lm_train.data.inputs import resolve_inputs
from lm_train.data.record_formats import format_tag, processor_for, text_field
from lm_train.data.tokenizer import configured_tokenizer, provide_tokenizer, tokenizer_bytes, wait_for_tokenizer
from lm_train.errors import DataError
from shard_cache import SETTINGS_NAME, BuildHandle, get_fs

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """The tokenizer and the train/validation caches of a run, possibly still being built."""

    tokenizer_path: str
    train_cache: str
    validation_cache: str | None
    builds: list[BuildHandle]
    build_metrics: LatestBuildMetrics | None = None
    """The train cache's build counts while it builds in the background (None when it was already built)."""

    def tokenizer(self):
        return shard_cache.load_tokenizer(self.tokenizer_path)

    def vocab_size(self) -> int:
        return self.tokenizer().get_vocab_size(with_added_tokens=True)

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
                logger.warning("%s; it may still be writing to one of: %s", e, self.describe())

    def check_builds(self) -> None:
        """Raise the error of a background build that has failed."""
        for handle in self.builds:
            if handle.done():
                handle.wait()

    def describe(self) -> str:
        parts = [f"tokenizer {self.tokenizer_path}", f"train {self.train_cache}"]
        if self.validation_cache:
            parts.append(f"validation {self.validation_cache}")
        return ", ".join(parts)


def cache_tag(tokenizer_path: str, config: DataConfig, processor: Any = None) -> str:
    """The cache folder's name: the tokenizer's content (another tokenizer never reuses stale tokens), the
    cache format (`sc4`: shard-cache 0.4's round-robin file order, so that a cache of 0.3's grouped files, which
    0.4 refuses, is not reused) and the settings that change the tokens (the record format's, when `processor`
    is given: plain text caches keep the folder they always had)."""
    tag = "tok-" + hashlib.sha256(tokenizer_bytes(tokenizer_path)).hexdigest()[:12] + "-sc4"
    tag = tag if config.enforce_eos else tag + "-own-special-tokens"
    return tag + (format_tag(config, processor) if processor is not None else "")


def prepare_data(
    config: DataConfig,
    *,
    background: bool = True,
    progress: Any = True,
    metrics_callback: Callable[[Any], None] | None = None,
    builder: bool = True,
) -> PreparedData:
    """Find or train the tokenizer, then find, resume or start the cache builds (in the background if asked).

    In a multi-process run only one process is the `builder`; the others wait for the tokenizer it trains and
    read the caches it writes (cache_dir must then be storage that every process sees).
    """
    if config.prebuilt:
        return prebuilt_data(config)
    inputs = resolve_inputs(config)
    tokenizer_path = provide_tokenizer(config, inputs, progress=bool(progress)) if builder else wait_for_tokenizer(config)
    processor = processor_for(config, tokenizer_path)
    base = f"{config.cache_dir.rstrip('/')}/{cache_tag(tokenizer_path, config, processor)}"
    train_cache = f"{base}/train"
    validation_cache = f"{base}/validation" if inputs.validation else None
    if not builder:
        return PreparedData(tokenizer_path, train_cache, validation_cache, [])
    options: dict[str, Any] = dict(
        processor=processor,
        # Hundreds of small files make better work units when grouped: a Ray task per ~1/64 of the corpus.
        files_per_shard=max(1, len(inputs.train) // 64) if inputs.fmt == "text" else 1,
        fmt=inputs.fmt,
        text_field=text_field(config),
        on_bad_input=config.on_bad_input,
        chunk_size=config.chunk_size,
        num_workers=config.num_workers,
        progress=progress,
    )
    jobs = [(inputs.validation, validation_cache, None)] if validation_cache else []
    watched = LatestBuildMetrics() if background and metrics_callback is None else None
    jobs.append((inputs.train, train_cache, metrics_callback or watched))
    builds: list[BuildHandle] = []
    for files, cache_dir, callback in jobs:
        # A finished cache is only checked against these settings (no Ray start); others are built or resumed.
        if background and not _finished(cache_dir):
            builds.append(shard_cache.start_build(files, cache_dir, metrics_callback=callback, **options))
        else:
            shard_cache.build_cache(files, cache_dir, metrics_callback=callback, **options)
            watched = None if cache_dir == train_cache else watched  # built before training: nothing to watch
    return PreparedData(tokenizer_path, train_cache, validation_cache, builds, watched)


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
