"""Build a cache: shard tasks (on Ray workers, or in this process) tokenize chunks, the driver commits them."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shard_cache.build_failures import clear_failure, record_failure
from shard_cache.chunks import metadata_bytes, metadata_path, parquet_path
from shard_cache.errors import CacheMismatchError, ShardCacheError
from shard_cache.executors import choose_in_process, run_in_process, run_on_ray
from shard_cache.fs import (
    get_fs,
    is_local,
    is_process_local,
    join,
    read_bytes,
    remove_leftover_tmp_files,
    storage_env,
    write_atomic,
)
from shard_cache.inputs import Shard, expand_inputs, group_into_shards
from shard_cache.ledger import LEDGER_NAME, SETTINGS_NAME, ChunkEntry, Ledger
from shard_cache.lock import BuildLock, acquire
from shard_cache.processor import BatchProcessor, TokenizerProcessor
from shard_cache.progress import BuildMetrics, BuildProgress, input_size
from shard_cache.recovery import finished_ledger, load_build_ledger
from shard_cache.sources import FORMATS, POLICIES
from shard_cache.worker import ShardTask

CACHE_FORMAT = "shard-cache/1"
LEDGER_WRITE_INTERVAL_S = 0.25
HEARTBEAT_INTERVAL_S = 30.0
LOCK_CHECK_INTERVAL_S = 2.0  # a builder that lost its lock writes at most this long before it notices
log = logging.getLogger("shard_cache")


@dataclass
class BuildOptions:
    """How to read the inputs and cut them into chunks."""

    fmt: str = "auto"
    text_field: str = "text"
    chunk_size: int = 1024
    files_per_shard: int = 1
    on_bad_input: str = "fail"
    num_workers: int | None = None
    ray_address: str | None = None
    in_process: bool | None = None  # None: in this process for small inputs (see build_cache)
    progress: Any = True  # bool, a rich Console, or a started rich Progress (see shard_cache.progress)
    metrics_callback: Callable[[BuildMetrics], None] | None = None
    stop: threading.Event | None = None

    def validate(self) -> None:
        if self.fmt not in FORMATS:
            raise ShardCacheError(f"format {self.fmt!r} is unknown; use one of {', '.join(FORMATS)}.")
        if self.on_bad_input not in POLICIES:
            raise ShardCacheError(f"on_bad_input {self.on_bad_input!r} is unknown; use 'fail' or 'skip'.")
        if self.chunk_size < 1:
            raise ShardCacheError(f"chunk_size must be at least 1 document, got {self.chunk_size}.")
        if self.num_workers is not None and self.num_workers < 1:
            raise ShardCacheError(f"num_workers must be at least 1, got {self.num_workers}.")


@dataclass
class BuildResult:
    """Totals of a finished build."""

    cache_dir: str
    shards: int
    chunks: int
    docs: int
    tokens: int
    skipped: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    finished: bool = True  # False when the build was stopped early: building again resumes it
    empty_inputs: tuple[str, ...] = ()  # input files that gave no document (empty, or every document skipped)


def _settings(shards: list[Shard], processor: BatchProcessor, options: BuildOptions) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "processor": processor.fingerprint(),
        "chunk_size": options.chunk_size,
        "input_format": options.fmt,
        "text_field": options.text_field,
        "on_bad_input": options.on_bad_input,
        "shards": [{"name": s.name, "files": list(s.files)} for s in shards],
    }


def _settings_bytes(settings: dict[str, Any]) -> bytes:
    return (json.dumps(settings, indent=1, sort_keys=True) + "\n").encode("utf-8")


def _check_settings(fs: Any, path: str, url: str, wanted: dict[str, Any]) -> None:
    try:
        existing = json.loads(read_bytes(fs, path))
    except ValueError as exc:
        raise CacheMismatchError(f"{url}/{SETTINGS_NAME}: not valid JSON ({exc}). Build into a new directory.") from exc
    differing = sorted(k for k in set(existing) | set(wanted) if existing.get(k) != wanted.get(k))
    if differing:
        key = differing[0]
        change = f"{key!r} was {_brief(existing.get(key))}, now {_brief(wanted.get(key))}"
        if key == "shards" and _grouped_consecutively(existing.get(key), wanted.get(key)):
            change = (
                "the same files are grouped into shards differently (since shard-cache 0.4, files_per_shard "
                "deals them round-robin, so that every shard mixes the corpus)"
            )
        raise CacheMismatchError(
            f"{url} already holds a cache built with other settings: {change} (differing keys: "
            f"{', '.join(differing)}). Build into a new directory, or delete this one to rebuild it."
        )


def _brief(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


def _grouped_consecutively(existing: Any, wanted: Any) -> bool:
    """Whether the `existing` shards are consecutive groups (shard-cache 0.3 and older) of the very files, in the
    same order, that the `wanted` shards deal round-robin (and not, say, the same files given in another order)."""
    try:
        old = [tuple(shard["files"]) for shard in existing]
        new = [tuple(shard["files"]) for shard in wanted]
    except (TypeError, KeyError):
        return False
    files = [f for group in old for f in group]
    size = max(map(len, old), default=0)
    if size < 2 or old != [tuple(files[i : i + size]) for i in range(0, len(files), size)]:
        return False
    return [s.files for s in group_into_shards(files, size)] == new


def _make_processor(tokenizer: Any, processor: BatchProcessor | None) -> BatchProcessor:
    if processor is not None:
        if tokenizer is not None:
            raise ShardCacheError("pass either tokenizer= or processor=, not both.")
        return processor
    if tokenizer is None:
        raise ShardCacheError("no tokenizer: pass tokenizer= (a tokenizer.json, an HF directory or a Tokenizer).")
    return TokenizerProcessor(tokenizer)


def build_cache(
    inputs: Sequence[str] | str,
    cache_dir: str,
    *,
    tokenizer: Any = None,
    processor: BatchProcessor | None = None,
    fmt: str = "auto",
    text_field: str = "text",
    chunk_size: int = 1024,
    files_per_shard: int = 1,
    on_bad_input: str = "fail",
    num_workers: int | None = None,
    ray_address: str | None = None,
    in_process: bool | None = None,
    progress: Any = True,
    metrics_callback: Callable[[BuildMetrics], None] | None = None,
    stop: threading.Event | None = None,
) -> BuildResult:
    """Build (or resume, or find finished) the cache of `inputs` at `cache_dir` (a path or fsspec URL).

    `tokenizer` is a tokenizer.json path, an HF tokenizer directory or a `tokenizers.Tokenizer`; or pass any
    `processor`. Each input file is a shard (or, with `files_per_shard` > 1, the files are dealt round-robin
    into shards of that many: shard s holds files s, s + S, ...); every `chunk_size` documents of a shard make
    one chunk, and the global order takes chunk r of every shard, round by round.
    `in_process`: True tokenizes the shards one after another in this process (no Ray, `num_workers` unused);
    False runs them as Ray tasks, on a Ray started locally on demand or joined at `ray_address`/RAY_ADDRESS;
    None (the default) builds in this process when no `ray_address` is given and the inputs' sizes are known and
    total at most `shard_cache.executors.IN_PROCESS_MAX_BYTES` (4 MiB), else with Ray. RAY_ADDRESS alone does
    not force Ray. Either way the cache holds the same bytes.
    Setting `stop` ends the build early (within about half a second; in-process, once the chunk being
    tokenized is done): the chunks committed so far stay, the
    result says `finished=False`, and building again resumes where it stopped. `progress` is True (a bar on a
    terminal, plain lines elsewhere), False, a rich Console, or a started rich Progress to add a task to.
    A missing or damaged ledger is rebuilt from the chunk files.
    """
    options = BuildOptions(
        fmt=fmt,
        text_field=text_field,
        chunk_size=chunk_size,
        files_per_shard=files_per_shard,
        on_bad_input=on_bad_input,
        num_workers=num_workers,
        ray_address=ray_address,
        in_process=in_process,
        progress=progress,
        metrics_callback=metrics_callback,
        stop=stop,
    )
    return _Builder(inputs, cache_dir, _make_processor(tokenizer, processor), options).run()


class _Builder:
    def __init__(self, inputs: Sequence[str] | str, cache_dir: str, processor: BatchProcessor, options: BuildOptions):
        options.validate()
        self.url = cache_dir
        self.fs, self.root = get_fs(cache_dir)
        self.processor = processor
        self.options = options
        self.shards = group_into_shards(
            expand_inputs(list(inputs) if not isinstance(inputs, str) else inputs), options.files_per_shard
        )
        self.settings = _settings(self.shards, processor, options)
        self.worker_writes = not is_process_local(self.fs)
        self._lock_checked = time.monotonic()

    def run(self) -> BuildResult:
        started = time.monotonic()
        settings_path = join(self.root, SETTINGS_NAME)
        if self.fs.exists(settings_path):
            _check_settings(self.fs, settings_path, self.url, self.settings)
            finished = finished_ledger(self.fs, self.root, self.url, self.shards)
            if finished is not None:  # nothing to write, so no lock: builds of a finished cache run side by side
                return _result(self.url, finished, time.monotonic() - started)
        lock = acquire(self.fs, self.root, self.url)
        try:
            if not self.fs.exists(settings_path):
                write_atomic(self.fs, settings_path, _settings_bytes(self.settings))
            ledger, note = load_build_ledger(self.fs, self.root, self.url, self.shards)
            if note:
                log.warning(note)
            if not ledger.finished:
                remove_leftover_tmp_files(self.fs, self.root)
                self._process(ledger, lock)
                # again at the end: a killed builder's last worker may have been mid-write when this one started
                remove_leftover_tmp_files(self.fs, self.root)
        finally:
            lock.release()
        return _result(self.url, ledger, time.monotonic() - started)

    def write_ledger(self, ledger: Ledger, lock: BuildLock) -> None:
        ledger.refresh_order()
        now = time.monotonic()
        if now - self._lock_checked >= LOCK_CHECK_INTERVAL_S or ledger.finished:
            if not lock.still_held():  # never overwrite the ledger of the builder that took over
                raise lock.lost()
            self._lock_checked = now
        write_atomic(self.fs, join(self.root, LEDGER_NAME), ledger.to_json())

    def _process(self, ledger: Ledger, lock: BuildLock) -> None:
        ledger.error = None
        sizes = [[input_size(f) for f in s.files] for s in self.shards]
        in_process = choose_in_process(
            self.options.in_process, self.options.ray_address, [x for group in sizes for x in group]
        )
        tracker = BuildProgress(
            self.shards, ledger, self.options.progress, self.options.metrics_callback, time.monotonic(), sizes=sizes
        )
        sink = _Committer(self, ledger, lock, tracker)
        pending = [i for i, state in enumerate(ledger.shards) if not state.done]
        stop = self.options.stop or threading.Event()  # never set when the caller gave none
        try:
            if in_process:
                run_in_process(pending, lambda shard: self._task(shard, ledger, lock), self.processor, sink, stop)
            else:
                run_on_ray(
                    pending,
                    lambda shard: self._task(shard, ledger, lock),
                    self.processor,
                    sink,
                    stop,
                    ray_address=self.options.ray_address,
                    num_workers=self.options.num_workers,
                )
        except BaseException as exc:
            cause = getattr(exc, "cause", None)
            error = cause if isinstance(cause, ShardCacheError) else exc
            # keep every chunk committed so far, and tell waiting readers why no more will come
            ledger.error = f"{type(error).__name__}: {error}"
            # the disk is full or the lock is lost: the ledger on disk then stays as it was, intact
            with contextlib.suppress(ShardCacheError):
                self.write_ledger(ledger, lock)
            tracker.close()
            if isinstance(cause, ShardCacheError):
                raise cause.with_traceback(None) from None
            raise
        self.write_ledger(ledger, lock)
        tracker.report()
        tracker.close()

    def _task(self, shard: int, ledger: Ledger, lock: BuildLock) -> ShardTask:
        return ShardTask(
            shard=shard,
            files=self.shards[shard].files,
            fmt=self.options.fmt,
            text_field=self.options.text_field,
            on_bad_input=self.options.on_bad_input,
            chunk_size=self.options.chunk_size,
            start_chunk=len(ledger.shards[shard].chunks),
            cache_url=self.root if is_local(self.fs) else self.url,  # absolute: workers run elsewhere
            lock_token=lock.token,
            worker_writes=self.worker_writes,
            lock_epoch=lock.epoch,
            storage_env=tuple(sorted(storage_env().items())),
        )

    def commit_message(self, ledger: Ledger, shard: int, message: dict[str, Any], tracker: BuildProgress) -> None:
        state = ledger.shards[shard]
        if message.get("done"):
            state.done = True
            state.skipped = dict(message["skipped"])
            state.empty_files = list(message.get("empty_files", []))
            for url in state.empty_files:
                tracker.note(f"{url}: gave no document (the file is empty, or every document was skipped).")
            return
        chunk = message["chunk"]
        if chunk != len(state.chunks):
            raise ShardCacheError(f"shard {shard}: chunk {chunk} arrived out of order (expected {len(state.chunks)}).")
        meta = message["meta"]
        if not self.worker_writes:
            write_atomic(self.fs, parquet_path(self.root, shard, chunk), message["data"])
            write_atomic(self.fs, metadata_path(self.root, shard, chunk), metadata_bytes(meta))
        state.chunks.append(ChunkEntry(docs=meta["docs"], tokens=meta["tokens"], crc32c=message["crc32c"]))
        state.skipped = dict(meta["skipped_so_far"])


class _Committer:
    """Commits the shard tasks' messages for a builder, writing the ledger and beating the lock when due."""

    def __init__(self, builder: _Builder, ledger: Ledger, lock: BuildLock, tracker: BuildProgress):
        self.builder, self.ledger, self.lock, self.tracker = builder, ledger, lock, tracker
        self.last_write = self.last_beat = time.monotonic()
        self.dirty = False

    def deliver(self, shard: int, message: dict[str, Any]) -> None:
        """Commit one message of shard `shard`'s task."""
        self.builder.commit_message(self.ledger, shard, message, self.tracker)
        self.tracker.update(shard, message)
        self.dirty = True

    def tick(self, idle: bool) -> None:
        """Write the ledger when it has changed and is due (or nothing runs), and beat the lock when due."""
        now = time.monotonic()
        if self.dirty and (now - self.last_write >= LEDGER_WRITE_INTERVAL_S or idle):
            self.builder.write_ledger(self.ledger, self.lock)
            self.tracker.report()
            self.last_write, self.dirty = now, False
        if now - self.last_beat >= HEARTBEAT_INTERVAL_S:
            self.lock.heartbeat()
            self.last_beat = now


def _result(url: str, ledger: Ledger, elapsed: float) -> BuildResult:
    skipped: dict[str, int] = {}
    for state in ledger.shards:
        for reason, count in state.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + count
    return BuildResult(
        cache_dir=url,
        shards=len(ledger.shards),
        chunks=sum(len(s.chunks) for s in ledger.shards),
        docs=sum(c.docs for s in ledger.shards for c in s.chunks),
        tokens=sum(c.tokens.get("input_ids", 0) for s in ledger.shards for c in s.chunks),
        skipped=dict(sorted(skipped.items())),
        elapsed_s=elapsed,
        finished=ledger.finished,
        empty_inputs=tuple(f for s in ledger.shards for f in s.empty_files),
    )


class BuildHandle:
    """A build running in a background thread; `stop_event` is the event that the build's `stop=` watches."""

    def __init__(self, target: Callable[[], BuildResult], stop_event: threading.Event, url: str = ""):
        self.result: BuildResult | None = None
        self.error: BaseException | None = None
        self.url = url
        self._stop_event = stop_event
        clear_failure(url)
        self._thread = threading.Thread(target=self._run, args=(target,), name="shard-cache-build", daemon=True)
        self._thread.start()

    def _run(self, target: Callable[[], BuildResult]) -> None:
        try:
            self.result = target()
        except BaseException as exc:
            self.error = exc
            record_failure(self.url, exc)  # readers of this cache in this process stop waiting for it

    def done(self) -> bool:
        """True once the build has finished or failed."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> BuildResult:
        """Block until the build ends; return its result or raise its error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the cache build did not finish within {timeout} s.")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def stop(self, timeout: float | None = 60.0) -> None:
        """Ask the build to stop, keeping what it committed, and wait for its thread (a later build resumes it).

        Does not raise the build's own error (`wait` does); raises TimeoutError if the thread outlives `timeout`.
        """
        self._stop_event.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the cache build did not stop within {timeout} s.")


def start_build(inputs: Sequence[str] | str, cache_dir: str, **kwargs: Any) -> BuildHandle:
    """Start `build_cache` in a background thread; returns a handle to wait on.

    Ray, when the build uses it, starts (or is joined) in that thread too, so its start-up overlaps whatever the
    caller does next.
    """
    stop = threading.Event()
    return BuildHandle(lambda: build_cache(inputs, cache_dir, stop=stop, **kwargs), stop, cache_dir)
