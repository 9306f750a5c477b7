"""Read a cache, also while it is being built: committed chunks only, in the global round-robin order."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from shard_cache.build_failures import build_failure
from shard_cache.chunk_reading import arrow_to_numpy, read_chunk_columns
from shard_cache.errors import CacheCorruptError, ShardCacheError
from shard_cache.examples import Documents, TokenWindows
from shard_cache.fs import get_fs, join, read_bytes
from shard_cache.ledger import LEDGER_NAME, Ledger


@dataclass
class ChunkData:
    """One chunk's `input_ids`, flat, with the document boundaries."""

    tokens: np.ndarray  # int32, all documents concatenated
    doc_offsets: np.ndarray  # int64, len(docs) + 1
    # Other per-token list columns (one value per token of input_ids, e.g. `loss_mask`), flat like `tokens`.
    token_columns: dict[str, np.ndarray] = field(default_factory=dict)
    # String columns: one value per document (e.g. a prompt cache's `record`).
    document_values: dict[str, list[str]] = field(default_factory=dict)


class CacheReader:
    """Committed chunks of a cache in global order, with token and document offsets for instant seeking.

    The ledger is re-read at most every `poll_interval` seconds; `max_cached_chunks` decoded chunks are kept.
    Each chunk's CRC-32C is checked against the ledger the first time it is read (`verify_checksums`); a
    damaged chunk raises ChunkCorruptError naming it and its source, or, with a `repairer` (a function
    (shard, chunk) -> None that rebuilds the chunk in place, such as shard_cache.repair.chunk_repairer's), is
    rebuilt and read again.
    """

    def __init__(
        self,
        cache_dir: str,
        *,
        poll_interval: float = 0.2,
        max_cached_chunks: int = 64,
        verify_checksums: bool = True,
        repairer: Callable[[int, int], None] | None = None,
    ):
        self.url = cache_dir
        self.verify_checksums = verify_checksums
        self.repairer = repairer
        self._verified: set[tuple[int, int]] = set()
        self.fs, self.root = get_fs(cache_dir)
        self.poll_interval = poll_interval
        self.max_cached_chunks = max_cached_chunks
        self.chunks_loaded: list[tuple[int, int]] = []  # (shard, chunk) of every load, for accounting
        self._cache: OrderedDict[int, ChunkData] = OrderedDict()
        self._ledger: Ledger | None = None
        self._last_poll = 0.0
        self._order: list[tuple[int, int]] = []
        self._token_starts = np.zeros(1, dtype=np.int64)  # cumulative tokens before each global chunk
        self._doc_starts = np.zeros(1, dtype=np.int64)
        self._lock = threading.RLock()  # a prefetch thread and the training loop may share one reader

    # ---- ledger ----
    def refresh(self, force: bool = False) -> None:
        """Re-read the ledger (rate-limited unless `force`)."""
        with self._lock:
            self._refresh(force)

    def _refresh(self, force: bool) -> None:
        now = time.monotonic()
        if (
            not force
            and self._ledger is not None
            and (self._ledger.finished or now - self._last_poll < self.poll_interval)
        ):
            return
        self._last_poll = now
        path = join(self.root, LEDGER_NAME)
        try:
            data = read_bytes(self.fs, path)
        except FileNotFoundError:
            return  # the build has not committed its first chunk yet
        ledger = Ledger.from_json(data, where=f"{self.url}/{LEDGER_NAME}")
        if ledger.order[: len(self._order)] != self._order:
            raise CacheCorruptError(
                f"{self.url}: the ledger's global order changed under the reader; the cache was rebuilt with "
                "other inputs. Reopen the reader."
            )
        new = ledger.order[len(self._order) :]
        if new:
            tokens = [ledger.shards[s].chunks[c].tokens.get("input_ids", 0) for s, c in new]
            docs = [ledger.shards[s].chunks[c].docs for s, c in new]
            self._token_starts = np.concatenate([self._token_starts, self._token_starts[-1] + np.cumsum(tokens)])
            self._doc_starts = np.concatenate([self._doc_starts, self._doc_starts[-1] + np.cumsum(docs)])
            self._order = list(ledger.order)
        self._ledger = ledger

    @property
    def finished(self) -> bool:
        """True once every shard is done (the counts below are then final)."""
        self.refresh()
        return self._ledger is not None and self._ledger.finished

    @property
    def num_chunks(self) -> int:
        self.refresh()
        return len(self._order)

    @property
    def num_tokens(self) -> int:
        """Tokens in the committed prefix of the global order."""
        self.refresh()
        return int(self._token_starts[-1])

    @property
    def num_docs(self) -> int:
        """Documents in the committed prefix of the global order."""
        self.refresh()
        return int(self._doc_starts[-1])

    def committed_state(self) -> tuple[int, bool]:
        """From one reading of the ledger: the tokens of the committed prefix, and whether the build has finished."""
        with self._lock:
            self._refresh(False)
            return int(self._token_starts[-1]), self._ledger is not None and self._ledger.finished

    def wait_until(self, condition, timeout: float | None, what: str) -> None:
        """Poll the ledger until `condition()` holds; TimeoutError after `timeout` seconds (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.refresh(force=True)
            if condition():
                return
            if self._ledger is not None and self._ledger.finished:
                raise IndexError(f"{self.url}: {what}, but the finished cache does not have it.")
            failed = self._ledger.error if self._ledger is not None and self._ledger.error else build_failure(self.url)
            if failed:
                raise ShardCacheError(
                    f"{self.url}: waiting for {what}, but the build stopped: {failed}. Fix the cause and run the "
                    "build again; it resumes."
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.url}: waited {timeout} s for {what}; the build has committed {len(self._order)} "
                    "chunks so far. Is the build still running? Pass a longer timeout."
                )
            time.sleep(self.poll_interval)

    def token_windows(self, seq_len: int) -> TokenWindows:
        """Examples as windows of `seq_len` tokens over the concatenated documents."""
        return TokenWindows(self, seq_len)

    def documents(self) -> Documents:
        """Examples as whole documents."""
        return Documents(self)

    # ---- chunks ----
    def chunk(self, global_index: int) -> ChunkData:
        """The decoded chunk at position `global_index` of the global order."""
        with self._lock:
            return self._chunk(global_index)

    def _chunk(self, global_index: int) -> ChunkData:
        cached = self._cache.get(global_index)
        if cached is not None:
            self._cache.move_to_end(global_index)
            return cached
        shard, chunk = self._order[global_index]
        assert self._ledger is not None
        check = self.verify_checksums and (shard, chunk) not in self._verified
        entry = self._ledger.shards[shard].chunks[chunk]
        column, table = read_chunk_columns(self, shard, chunk, entry.crc32c if check else None, check, "input_ids")
        if check:
            self._verified.add((shard, chunk))
        offsets = arrow_to_numpy(column.offsets).astype(np.int64)
        tokens = arrow_to_numpy(column.values).astype(np.int32, copy=False)
        data = ChunkData(
            tokens=tokens[offsets[0] : offsets[-1]],
            doc_offsets=offsets - offsets[0],
            token_columns=_token_columns(table, column),
            document_values={
                name: table.column(name).to_pylist()
                for name in table.column_names
                if pa.types.is_string(table.schema.field(name).type)
            },
        )
        self.chunks_loaded.append((shard, chunk))
        self._cache[global_index] = data
        if len(self._cache) > self.max_cached_chunks:
            self._cache.popitem(last=False)
        return data

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated committed stream (must be committed already)."""
        first = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        pieces = []
        position, g = start, first
        while position < stop:
            data = self.chunk(g)
            begin = position - int(self._token_starts[g])
            end = min(stop - int(self._token_starts[g]), len(data.tokens))
            pieces.append(data.tokens[begin:end])
            position += end - begin
            g += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document(self, index: int) -> np.ndarray:
        """Tokens of document `index` in global order (must be committed already)."""
        g = int(np.searchsorted(self._doc_starts, index, side="right")) - 1
        data = self.chunk(g)
        local = index - int(self._doc_starts[g])
        return data.tokens[data.doc_offsets[local] : data.doc_offsets[local + 1]]

    def document_column(self, index: int, name: str) -> np.ndarray | None:
        """Per-token column `name` (e.g. `loss_mask`) of document `index`, or None if the cache has no such column."""
        g = int(np.searchsorted(self._doc_starts, index, side="right")) - 1
        data = self.chunk(g)
        values = data.token_columns.get(name)
        if values is None:
            return None
        local = index - int(self._doc_starts[g])
        return values[data.doc_offsets[local] : data.doc_offsets[local + 1]]

    def document_value(self, index: int, name: str) -> str | None:
        """String column `name` of document `index` (committed already), or None if the cache has no such column."""
        g = int(np.searchsorted(self._doc_starts, index, side="right")) - 1
        values = self.chunk(g).document_values.get(name)
        return None if values is None else values[index - int(self._doc_starts[g])]

    def chunks_for_tokens(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The (shard, chunk) pairs that hold tokens [start, stop): what reading them must load."""
        first = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        last = int(np.searchsorted(self._token_starts, stop - 1, side="right")) - 1
        return [self._order[g] for g in range(first, last + 1)]


def _token_columns(table: pa.Table, input_ids: pa.ListArray) -> dict[str, np.ndarray]:
    """The list columns of a chunk with exactly input_ids' row lengths, as flat numpy arrays."""
    out = {}
    reference = arrow_to_numpy(input_ids.offsets)
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if name == "input_ids" or not pa.types.is_list(column.type):
            continue
        offsets = arrow_to_numpy(column.offsets)
        if np.array_equal(offsets - offsets[0], reference - reference[0]):
            out[name] = arrow_to_numpy(column.values)[offsets[0] : offsets[-1]]
    return out
