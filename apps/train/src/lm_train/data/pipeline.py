"""From the data config to batches: tokenizer (trained on first use), shard-cache builds, readers, prefetch."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import shard_cache
from shard_cache import BuildHandle, TokenWindows

from lm_train.config.schema import DataConfig
from lm_train.data.corpus import split_stdlib
from lm_train.errors import DataError

logger = logging.getLogger(__name__)

# How long a reader waits for the cache build to commit the examples a step needs.
DATA_TIMEOUT_S = 3600.0


@dataclass
class PreparedData:
    """The tokenizer and the train/validation caches of a run, possibly still being built."""

    tokenizer_path: str
    train_cache: str
    validation_cache: str | None
    builds: list[BuildHandle]

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


def tokenizer_json(path: str) -> Path:
    """The tokenizer.json of a tokenizer given as a file or as a Hugging Face tokenizer directory."""
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def _inputs(config: DataConfig) -> tuple[list[str], list[str], str]:
    """Train and validation input URLs, and their format."""
    if config.builtin == "python_stdlib":
        split = split_stdlib(config.validation_fraction)
        return [str(p) for p in split.train], [str(p) for p in split.validation], "text"
    if config.id is not None:
        return [config.id], [], "hf"
    train = _expand(config.train_urls, "data.train_urls")
    validation = _expand(config.validation_urls, "data.validation_urls") if config.validation_urls else []
    return train, validation, "auto"


def _expand(urls: tuple[str, ...], key: str) -> list[str]:
    try:
        files = shard_cache.expand_inputs(list(urls))
    except shard_cache.ShardCacheError as e:
        raise DataError(f"{key}: {e}") from None
    if not files:
        raise DataError(f"{key}: {list(urls)} matches no file. Check the paths (globs and {{1..N}} ranges work).")
    return files


def _wait_for_tokenizer(config: DataConfig, timeout: float = DATA_TIMEOUT_S) -> str:
    """The tokenizer that the building process provides (trained or configured)."""
    if config.tokenizer:
        return _tokenizer_path(config, [], "auto", progress=False)
    path = Path(config.cache_dir) / f"tokenizer-bpe{config.vocab_size}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise DataError(
                f"Waited {timeout:.0f} s for process 0 to train the tokenizer at {path}. data.cache_dir must be a "
                "directory that every process sees (a shared file system or a gs:// / s3:// URL)."
            )
        time.sleep(0.5)
    return str(path)


def _tokenizer_path(config: DataConfig, train_inputs: list[str], fmt: str, progress: bool) -> str:
    """The configured tokenizer, or a byte-level BPE trained on the train split and cached beside the data."""
    if config.tokenizer:
        path = Path(config.tokenizer).expanduser()
        if not path.exists():
            raise DataError(
                f"data.tokenizer: {config.tokenizer} does not exist. Give a tokenizer.json file or a Hugging Face "
                "tokenizer directory, or leave data.tokenizer empty to train a byte-level BPE on the training data."
            )
        return str(path)
    cached = Path(config.cache_dir) / f"tokenizer-bpe{config.vocab_size}.json"
    if cached.exists():
        return str(cached)
    if fmt != "text":
        raise DataError(
            "data.tokenizer is empty, and a tokenizer can be trained on first use only for the built-in corpus. "
            "Set data.tokenizer to a tokenizer.json (shard-cache's train_tokenizer can make one)."
        )
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Write beside, then rename: a run killed while training leaves no half-written tokenizer.
    partial = cached.with_suffix(f".partial-{os.getpid()}")
    shard_cache.train_tokenizer(
        [Path(p) for p in train_inputs], config.vocab_size, save_path=partial, show_progress=progress
    )
    os.replace(partial, cached)
    return str(cached)


def prepare_data(
    config: DataConfig,
    *,
    background: bool = True,
    progress: bool = True,
    metrics_callback: Callable[[Any], None] | None = None,
    builder: bool = True,
) -> PreparedData:
    """Find or train the tokenizer, then find, resume or start the cache builds (in the background if asked).

    In a multi-process run only one process is the `builder`; the others wait for the tokenizer it trains and
    read the caches it writes (cache_dir must then be storage that every process sees).
    """
    train_inputs, validation_inputs, fmt = _inputs(config)
    if builder:
        tokenizer_path = _tokenizer_path(config, train_inputs, fmt, progress)
    else:
        tokenizer_path = _wait_for_tokenizer(config)
    # The cache location names the tokenizer's content: another tokenizer never reuses stale tokens.
    tokenizer_tag = "tok-" + hashlib.sha256(tokenizer_json(tokenizer_path).read_bytes()).hexdigest()[:12]
    base = config.cache_dir.rstrip("/")
    train_cache = f"{base}/{tokenizer_tag}/train"
    validation_cache = f"{base}/{tokenizer_tag}/validation" if validation_inputs else None
    options: dict[str, Any] = dict(
        tokenizer=tokenizer_path,
        # Hundreds of small files make better work units when grouped: a Ray task per ~1/64 of the corpus.
        files_per_shard=max(1, len(train_inputs) // 64) if fmt == "text" else 1,
        fmt=fmt,
        text_field=config.text_key,
        chunk_size=config.chunk_size,
        num_workers=config.num_workers,
        progress=progress,
    )
    if not builder:
        return PreparedData(tokenizer_path, train_cache, validation_cache, [])
    jobs = [(validation_inputs, validation_cache, None)] if validation_cache else []
    jobs.append((train_inputs, train_cache, metrics_callback))
    builds: list[BuildHandle] = []
    for inputs, cache_dir, callback in jobs:
        # A finished cache is only checked against these settings (no Ray start); others are built or resumed.
        if background and not _finished(cache_dir):
            builds.append(shard_cache.start_build(inputs, cache_dir, metrics_callback=callback, **options))
        else:
            shard_cache.build_cache(inputs, cache_dir, metrics_callback=callback, **options)
    return PreparedData(tokenizer_path, train_cache, validation_cache, builds)


def _finished(cache_dir: str) -> bool:
    """Whether a cache's build has completed (False if it does not exist yet or is partial)."""
    try:
        return shard_cache.open_cache(cache_dir, timeout=0.0).finished
    except (FileNotFoundError, TimeoutError, shard_cache.ShardCacheError):
        return False


class TrainBatches:
    """The examples of each training step: a pure function of (cache, seq_len, seed, step, batch size)."""

    def __init__(
        self,
        data: PreparedData,
        seq_len: int,
        batch_size: int,
        seed: int,
        shuffle: bool | int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.data = data
        self.batch_size = batch_size
        self.process_index = process_index
        self.process_count = process_count
        reader = shard_cache.open_cache(data.train_cache, timeout=DATA_TIMEOUT_S)
        self.windows: TokenWindows = reader.token_windows(seq_len)
        if shuffle is True:
            self._order = None  # the full permutation needs the final size; made on first use
        elif shuffle is False:
            self._order = self.windows
        else:
            self._order = self.windows.era_shuffled(seed, int(shuffle))
        self.seed = seed
        self.shuffle = shuffle

    def _source(self):
        if self._order is None:
            self._order = self.windows.shuffled(self.seed, timeout=DATA_TIMEOUT_S)
        return self._order

    def indices(self, step: int) -> np.ndarray:
        """Global example positions of a step (this process's slice only)."""
        start = step * self.batch_size
        global_positions = np.arange(start, start + self.batch_size, dtype=np.int64)
        return shard_cache.process_slice(global_positions, self.process_index, self.process_count)

    def batch(self, step: int) -> np.ndarray:
        """This process's examples of `step`, as int32 [batch_size / process_count, seq_len]."""
        positions = self.indices(step)
        source = self._source()
        final = self.windows.final_num_examples()
        if final:  # epochs wrap around; positions inside the first epoch are unchanged
            positions = positions % final
        try:
            return source.get_batch(positions, timeout=DATA_TIMEOUT_S)
        except IndexError:  # the build finished with fewer examples than this step asked for
            final = self.windows.wait_for_final(timeout=DATA_TIMEOUT_S)
            if final == 0:
                raise DataError(
                    f"The training data has no example of {self.windows.seq_len} tokens: give more text or a "
                    "shorter model.seq_len."
                ) from None
            return source.get_batch(positions % final, timeout=DATA_TIMEOUT_S)


class Prefetcher:
    """Prepares the batches of the next steps on a background thread, in step order."""

    _DONE = object()

    def __init__(self, make_batch: Callable[[int], Any], first_step: int, last_step: int, depth: int = 2):
        self._make = make_batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(first_step, last_step), daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, first: int, last: int) -> None:
        for step in range(first, last):
            if self._stop.is_set():
                return
            try:
                item = (step, self._make(step), None)
            except BaseException as e:  # handed to the consumer, raised there
                self._put((step, None, e))
                return
            if not self._put(item):
                return
        self._put(self._DONE)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            step, batch, error = item
            if error is not None:
                raise error
            yield step, batch

    def close(self) -> None:
        self._stop.set()


def validation_batches(
    data: PreparedData, seq_len: int, batch_size: int, max_batches: int | None, process_index: int, process_count: int
) -> Iterator[np.ndarray]:
    """One unshuffled pass over the validation cache, in full global batches."""
    if data.validation_cache is None:
        return iter(())
    reader = shard_cache.open_cache(data.validation_cache, timeout=DATA_TIMEOUT_S)
    windows = reader.token_windows(seq_len)
    batches = windows.iter_batches(
        batch_size, process_index=process_index, process_count=process_count, timeout=DATA_TIMEOUT_S
    )
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            return
        yield batch
