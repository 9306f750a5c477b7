"""PreferencePairs: the view that serves a cache of preference pairs (shard_cache.preference_records) to DPO.

It serves pair i as two rows of seq_len tokens each (chosen and rejected, padded), with loss masks in
lm_models' next_token_loss convention (mask[t]: predicting token t + 1 counts). A sequence longer than seq_len
keeps its first seq_len tokens (the response's end is cut; a prompt that fills seq_len leaves no target, and the
trainer then ignores the pair); `stats()` counts both cases.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from shard_cache.errors import ShardCacheError
from shard_cache.examples import EraShuffledExamples, PermutedExamples, committed_indices
from shard_cache.preference_records import IS_REJECTED, PAIR_FIELDS, PREFERENCE_FORMATS
from shard_cache.reader import CacheReader
from shard_cache.records import (
    LOSS_MASK,
)
from shard_cache.shuffle import SPREAD_ERAS, EraShuffle, FeistelPermutation


@dataclass
class PairStats:
    """Counts over the pairs served so far."""

    pairs: int = 0
    truncated_sequences: int = 0
    pairs_without_targets: int = 0


def _row(ids: np.ndarray, targets: np.ndarray, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """One sequence cut or padded to seq_len, its next-token loss mask, and whether it was cut."""
    n = min(len(ids), seq_len)
    row = np.full(seq_len, pad_id, dtype=np.int32)
    row[:n] = ids[:n]
    mask = np.zeros(seq_len, dtype=bool)
    mask[: n - 1] = targets[1:n]
    return row, mask, len(ids) > seq_len


class PreferencePairs:
    """Examples are the pairs of a preference cache, each as a chosen and a rejected row of seq_len tokens."""

    def __init__(self, reader: CacheReader, seq_len: int, *, pad_id: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 to hold a prediction, got {seq_len}.")
        self.reader = reader
        self.seq_len = int(seq_len)
        self.pad_id = int(pad_id)
        self._stats = PairStats()
        self._lock = threading.Lock()

    def num_examples_available(self) -> int:
        """Pairs committed so far."""
        return self.reader.num_docs

    def final_num_examples(self) -> int | None:
        """The total once the build has finished, else None."""
        return self.num_examples_available() if self.reader.finished else None

    def committed_examples(self) -> tuple[int, bool]:
        """The pairs committed so far, and whether that count is final."""
        finished = self.reader.finished  # read first: once it is True, the count read next is the final one
        return self.reader.num_docs, finished

    def wait_for_final(self, timeout: float | None = None) -> int:
        """Wait for the build to finish; return the number of pairs."""
        if not self.reader.finished:
            self.reader.wait_until(lambda: self.reader.finished, timeout, "the build to finish")
        return self.num_examples_available()

    def wait_for_examples(self, count: int, timeout: float | None = None) -> None:
        """Wait until `count` pairs are committed (IndexError if the finished cache has fewer)."""
        if self.num_examples_available() < count:
            self.reader.wait_until(lambda: self.reader.num_docs >= count, timeout, f"{count} preference pairs")

    def stats(self) -> PairStats:
        """Pairs served, sequences cut at seq_len, and pairs left with no target in a sequence."""
        with self._lock:
            return PairStats(**{f.name: getattr(self._stats, f.name) for f in fields(PairStats)})

    def pair(self, index: int) -> dict[str, np.ndarray]:
        """Pair `index` (committed already) as the four rows of PAIR_FIELDS."""
        ids = self.reader.document(index)
        targets = self.reader.document_column(index, LOSS_MASK)
        rejected = self.reader.document_column(index, IS_REJECTED)
        if targets is None or rejected is None:
            raise ShardCacheError(
                f"{self.reader.url}: document {index} has no {LOSS_MASK!r} and {IS_REJECTED!r} columns, so the cache "
                "does not hold preference pairs. Build it with a preference processor (shard_cache.preferences)."
            )
        split = int(np.argmax(rejected)) if rejected.any() else len(ids)
        chosen_ids, chosen_mask, chosen_cut = _row(ids[:split], targets[:split], self.seq_len, self.pad_id)
        rejected_ids, rejected_mask, rejected_cut = _row(ids[split:], targets[split:], self.seq_len, self.pad_id)
        with self._lock:
            self._stats.pairs += 1
            self._stats.truncated_sequences += int(chosen_cut) + int(rejected_cut)
            self._stats.pairs_without_targets += int(not (chosen_mask.any() and rejected_mask.any()))
        return dict(zip(PAIR_FIELDS, (chosen_ids, chosen_mask, rejected_ids, rejected_mask), strict=True))

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> dict[str, np.ndarray]:
        """Pairs at global `indices`: PAIR_FIELDS, each [len(indices), seq_len]; waits for uncommitted ones."""
        indices = committed_indices(self, indices, timeout)
        rows = [self.pair(int(i)) for i in indices]
        return {
            name: np.stack([r[name] for r in rows])
            if rows
            else np.zeros((0, self.seq_len), np.int32 if "ids" in name else bool)
            for name in PAIR_FIELDS
        }

    def shuffled(self, seed: int, timeout: float | None = None) -> PermutedExamples:
        """A full permutation of all pairs keyed by `seed`; waits for the build to finish."""
        total = self.wait_for_final(timeout)
        if total == 0:
            raise IndexError(f"{self.reader.url}: the cache holds no preference pair.")
        return PermutedExamples(self, FeistelPermutation(total, seed))  # type: ignore[arg-type]

    def era_shuffled(self, seed: int, era_length: int, spread: int = SPREAD_ERAS) -> EraShuffledExamples:
        """Shuffled in eras of `era_length` pairs that mix the last `spread` eras (see `EraShuffle`): usable while
        the cache is still being built."""
        return EraShuffledExamples(self, EraShuffle(seed, era_length, spread))  # type: ignore[arg-type]


__all__ = ["IS_REJECTED", "PAIR_FIELDS", "PREFERENCE_FORMATS", "PairStats", "PreferencePairs"]
