"""Packed examples: whole documents packed into sequences of seq_len tokens, with segment ids and positions.

The packing rule (a pure function of the cache and the settings, so every reader computes the same packs):
- documents are packed within their chunk, never across chunks, so a chunk's packs depend on that chunk alone
  and a sequence reads one chunk;
- a document longer than seq_len follows `long_documents`: "truncate" keeps its first seq_len tokens (for chat
  and prompt/completion records: the later turns go), "split" cuts it into pieces of seq_len (each its own
  segment; for pretraining), "drop" leaves it out; truncated and dropped documents are counted in `stats()`;
- the pieces of a chunk go, longest first (ties in document order), into the first sequence with room and fewer
  than `max_segments` pieces (first-fit decreasing); within a sequence the pieces keep document order, and
  sequences are numbered by their first piece.

Example i is a dict of [n, seq_len] arrays: `input_ids` (int32, `pad_id` after the last piece),
`segment_ids` (int32: 0, 1, ... per piece, -1 on padding), `positions` (int32, restarting at 0 in each piece)
and `loss_mask` (bool, in lm_models' next_token_loss convention: loss_mask[t] says whether predicting token
t + 1 at position t counts, which needs t + 1 in the same piece and a target there). Targets are the cache's
`loss_mask` column when it has one (chat, prompt/completion), else every token. So no loss falls on padding,
across a document boundary, or on a token the stored mask excludes.

Planning reads each chunk once (its document lengths); the index is a shuffled view's like TokenWindows':
`shuffled(seed)` waits for the build to finish, `era_shuffled` works while it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from shard_cache.examples import EraShuffledExamples, PermutedExamples, committed_indices, iter_global_batches
from shard_cache.reader import CacheReader, ChunkData
from shard_cache.records import LOSS_MASK
from shard_cache.shuffle import SPREAD_ERAS, EraShuffle, FeistelPermutation

LONG_DOCUMENT_RULES = ("truncate", "split", "drop")
PADDING_SEGMENT = -1
# One piece of a document in a packed sequence: (document index within its chunk, first token, end token).
Pieces = np.ndarray  # int64 [pieces, 3]


@dataclass
class PackingStats:
    """Counts over the planned chunks."""

    documents: int = 0
    sequences: int = 0
    tokens: int = 0  # tokens placed in sequences
    padding: int = 0  # padding tokens in the sequences
    truncated_documents: int = 0
    truncated_tokens: int = 0  # tokens cut off truncated documents
    dropped_documents: int = 0

    def add(self, other: PackingStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _pieces(lengths: np.ndarray, seq_len: int, rule: str, stats: PackingStats) -> np.ndarray:
    rows = []
    for doc, length in enumerate(lengths.tolist()):
        if length == 0:
            continue
        if length <= seq_len:
            rows.append((doc, 0, length))
        elif rule == "truncate":
            rows.append((doc, 0, seq_len))
            stats.truncated_documents += 1
            stats.truncated_tokens += length - seq_len
        elif rule == "split":
            rows.extend((doc, s, min(s + seq_len, length)) for s in range(0, length, seq_len))
        else:
            stats.dropped_documents += 1
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def plan_packs(
    lengths: Sequence[int] | np.ndarray,
    seq_len: int,
    *,
    long_documents: str = "truncate",
    max_segments: int | None = None,
) -> tuple[list[Pieces], PackingStats]:
    """The packed sequences of one chunk's documents (by their lengths), and the counts; see the module rule."""
    if long_documents not in LONG_DOCUMENT_RULES:
        raise ValueError(f"long_documents must be one of {LONG_DOCUMENT_RULES}, got {long_documents!r}.")
    if max_segments is not None and max_segments < 1:
        raise ValueError(f"max_segments must be at least 1 (or None), got {max_segments}.")
    lengths = np.asarray(lengths, dtype=np.int64)
    stats = PackingStats(documents=len(lengths))
    pieces = _pieces(lengths, seq_len, long_documents, stats)
    sizes = pieces[:, 2] - pieces[:, 1]
    room = np.empty(len(pieces), dtype=np.int64)
    count = np.zeros(len(pieces), dtype=np.int64)
    where = np.empty(len(pieces), dtype=np.int64)
    bins = 0
    limit = max_segments or len(pieces) + 1
    for p in np.lexsort((np.arange(len(pieces)), -sizes)):  # longest first, ties in document order
        fits = (room[:bins] >= sizes[p]) & (count[:bins] < limit)
        b = int(np.argmax(fits)) if fits.any() else bins
        if b == bins:
            room[b] = seq_len
            bins += 1
        room[b] -= sizes[p]
        count[b] += 1
        where[p] = b
    members = [np.flatnonzero(where == b) for b in range(bins)]  # piece indices ascending: document order
    members.sort(key=lambda m: int(m[0]))
    stats.sequences = bins
    stats.tokens = int(sizes.sum())
    stats.padding = bins * seq_len - stats.tokens
    return [pieces[m] for m in members], stats


def pack_sequence(
    pieces: Pieces,
    tokens: np.ndarray,
    doc_offsets: np.ndarray,
    targets: np.ndarray | None,
    seq_len: int,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """One packed sequence from its pieces over a chunk's flat tokens (and per-token targets, None: all)."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int32)
    segment_ids = np.full(seq_len, PADDING_SEGMENT, dtype=np.int32)
    positions = np.zeros(seq_len, dtype=np.int32)
    target = np.zeros(seq_len, dtype=bool)
    at = 0
    for segment, (doc, start, stop) in enumerate(pieces.tolist()):
        begin = int(doc_offsets[doc]) + start
        n = stop - start
        input_ids[at : at + n] = tokens[begin : begin + n]
        segment_ids[at : at + n] = segment
        positions[at : at + n] = np.arange(n, dtype=np.int32)
        target[at : at + n] = True if targets is None else targets[begin : begin + n]
        at += n
    loss_mask = np.zeros(seq_len, dtype=bool)
    same = (segment_ids[1:] == segment_ids[:-1]) & (segment_ids[1:] != PADDING_SEGMENT)
    loss_mask[:-1] = same & target[1:]
    return {"input_ids": input_ids, "segment_ids": segment_ids, "positions": positions, "loss_mask": loss_mask}


class PackedSequences:
    """Examples are packed sequences of whole documents (see the module docstring for the rule)."""

    def __init__(
        self,
        reader: CacheReader,
        seq_len: int,
        *,
        long_documents: str = "truncate",
        max_segments: int | None = None,
        pad_id: int = 0,
    ):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 to hold a prediction, got {seq_len}.")
        plan_packs([], seq_len, long_documents=long_documents, max_segments=max_segments)  # checks the settings
        self.reader = reader
        self.seq_len = int(seq_len)
        self.long_documents = long_documents
        self.max_segments = max_segments
        self.pad_id = int(pad_id)
        self._plans: list[list[Pieces]] = []
        self._starts = [0]  # packs before each planned chunk
        self._stats = PackingStats()
        self._lock = threading.Lock()  # a prefetch thread and the training loop may share one view

    # ---- planning ----
    def _plan_until(self, count: int | None) -> int:
        """Plan committed chunks in order until `count` packs exist (None: every committed chunk)."""
        committed = self.reader.num_chunks
        with self._lock:
            while len(self._plans) < committed and (count is None or self._starts[-1] < count):
                data = self.reader.chunk(len(self._plans))
                plan, stats = plan_packs(
                    np.diff(data.doc_offsets),
                    self.seq_len,
                    long_documents=self.long_documents,
                    max_segments=self.max_segments,
                )
                self._plans.append(plan)
                self._starts.append(self._starts[-1] + len(plan))
                self._stats.add(stats)
            return self._starts[-1]

    def num_examples_available(self) -> int:
        """Packed sequences of the chunks committed so far."""
        return self._plan_until(None)

    def final_num_examples(self) -> int | None:
        """The total once the build has finished, else None."""
        return self.num_examples_available() if self.reader.finished else None

    def committed_examples(self) -> tuple[int, bool]:
        """The sequences of the chunks committed so far, and whether that count is final."""
        finished = self.reader.finished  # read first: once it is True, the chunks planned next are all of them
        return self._plan_until(None), finished

    def wait_for_final(self, timeout: float | None = None) -> int:
        """Wait for the build to finish; return the total number of packed sequences."""
        if not self.reader.finished:
            self.reader.wait_until(lambda: self.reader.finished, timeout, "the build to finish")
        return self.num_examples_available()

    def wait_for_examples(self, count: int, timeout: float | None = None) -> None:
        """Wait until `count` sequences are planned (IndexError if the finished cache has fewer)."""
        if self._plan_until(count) >= count:
            return
        self.reader.wait_until(lambda: self._plan_until(count) >= count, timeout, f"{count} packed sequences")

    def stats(self) -> PackingStats:
        """Counts (documents, truncated, dropped, padding, ...) over the chunks planned so far."""
        return PackingStats(**{f.name: getattr(self._stats, f.name) for f in fields(PackingStats)})

    # ---- reading ----
    def _sequence(self, index: int) -> dict[str, np.ndarray]:
        g = int(np.searchsorted(self._starts, index, side="right")) - 1
        data: ChunkData = self.reader.chunk(g)
        targets = data.token_columns.get(LOSS_MASK)
        pieces = self._plans[g][index - self._starts[g]]
        return pack_sequence(pieces, data.tokens, data.doc_offsets, targets, self.seq_len, self.pad_id)

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Sequences at global `indices`: a dict of [len(indices), seq_len] arrays; waits for uncommitted ones."""
        indices = committed_indices(self, indices, timeout)
        rows = [self._sequence(int(i)) for i in indices]
        keys = ("input_ids", "segment_ids", "positions", "loss_mask")
        dtypes: dict[str, Any] = {"input_ids": np.int32, "segment_ids": np.int32, "positions": np.int32}
        return {
            k: np.stack([r[k] for r in rows]) if rows else np.zeros((0, self.seq_len), dtypes.get(k, bool))
            for k in keys
        }

    def iter_batches(
        self, batch_size: int, *, process_index: int = 0, process_count: int = 1, timeout: float | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """One unshuffled pass: this process's slice of each full global batch, in order."""
        return iter_global_batches(self, batch_size, process_index, process_count, timeout)

    def shuffled(self, seed: int, timeout: float | None = None) -> PermutedExamples:
        """A full permutation of all packed sequences keyed by `seed`; waits for the build to finish."""
        total = self.wait_for_final(timeout)
        if total == 0:
            raise IndexError(f"{self.reader.url}: the cache has no document to pack.")
        return PermutedExamples(self, FeistelPermutation(total, seed))  # type: ignore[arg-type]

    def era_shuffled(self, seed: int, era_length: int, spread: int = SPREAD_ERAS) -> EraShuffledExamples:
        """Shuffled in eras of `era_length` sequences that each mix the last `spread` eras (see `EraShuffle`):
        usable while the cache is still being built, and the same order whenever it is read."""
        return EraShuffledExamples(self, EraShuffle(seed, era_length, spread))  # type: ignore[arg-type]
