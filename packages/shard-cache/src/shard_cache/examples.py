"""Example views over a cache: token windows of seq_len or whole documents, unshuffled or shuffled.

Example i of the unshuffled view is a pure function of the cache; a shuffled view maps index i through a
permutation keyed by the seed. Readers fetch by global index, so R processes that each ask for their slice of
every global batch together read exactly the single-reader order, whatever R is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from shard_cache.shuffle import SPREAD_ERAS, EraShuffle, FeistelPermutation


class CommittedCache(Protocol):
    """What the views read from a cache: shard_cache.reader.CacheReader, which builds them, has all of it."""

    url: str

    @property
    def finished(self) -> bool:
        """Whether the build has finished (the counts are then final)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens in the committed prefix."""
        ...

    @property
    def num_docs(self) -> int:
        """Documents in the committed prefix."""
        ...

    def committed_state(self) -> tuple[int, bool]:
        """(committed tokens, finished) from one reading of the ledger."""
        ...

    def wait_until(self, condition, timeout: float | None, what: str) -> None:
        """Poll until `condition()` holds; TimeoutError after `timeout` seconds."""
        ...

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated documents."""
        ...

    def document(self, index: int) -> np.ndarray:
        """The token ids of document `index`."""
        ...

    def chunks_for_tokens(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The chunks that hold tokens [start, stop)."""
        ...


def process_slice(indices: Sequence[int] | np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """The contiguous part of a global batch's indices that process `process_index` of `process_count` reads."""
    indices = np.asarray(indices, dtype=np.int64)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}.")
    if len(indices) % process_count:
        raise ValueError(f"a global batch of {len(indices)} does not split evenly over {process_count} processes.")
    per = len(indices) // process_count
    return indices[process_index * per : (process_index + 1) * per]


class BatchSource(Protocol):
    """A view that fetches by global index: TokenWindows, PackedSequences and PreferencePairs."""

    def wait_for_examples(self, count: int, timeout: float | None = None) -> None:
        """Wait until `count` examples are committed (IndexError if the finished cache has fewer)."""

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> Any:
        """Examples at global `indices`."""


def global_indices(indices: Sequence[int] | np.ndarray) -> np.ndarray:
    """`indices` as a flat int64 array; IndexError if one is negative."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(indices) and indices.min() < 0:
        raise IndexError(f"example indices must be >= 0, got {int(indices.min())}.")
    return indices


def committed_indices(source: BatchSource, indices: Sequence[int] | np.ndarray, timeout: float | None) -> np.ndarray:
    """`global_indices(indices)`, once every example they name is committed in `source`."""
    indices = global_indices(indices)
    if len(indices):
        source.wait_for_examples(int(indices.max()) + 1, timeout)
    return indices


def iter_global_batches(
    source: BatchSource, batch_size: int, process_index: int, process_count: int, timeout: float | None
) -> Iterator[Any]:
    """One unshuffled pass over `source`: this process's slice of each full global batch, in order."""
    batch = 0
    while True:
        wanted = (batch + 1) * batch_size
        try:
            source.wait_for_examples(wanted, timeout)
        except IndexError:
            return  # the finished cache holds no further full batch
        indices = np.arange(batch * batch_size, wanted)
        yield source.get_batch(process_slice(indices, process_index, process_count))
        batch += 1


class TokenWindows:
    """Examples are consecutive windows of `seq_len` tokens over the concatenated documents (EOS-separated)."""

    def __init__(self, reader: CommittedCache, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}.")
        self.reader = reader
        self.seq_len = int(seq_len)

    def num_examples_available(self) -> int:
        """Examples committed so far."""
        return self.reader.num_tokens // self.seq_len

    def final_num_examples(self) -> int | None:
        """The total once the build has finished, else None."""
        return self.num_examples_available() if self.reader.finished else None

    def committed_examples(self) -> tuple[int, bool]:
        """From one reading of the ledger: the examples committed so far, and whether that count is final."""
        tokens, finished = self.reader.committed_state()
        return tokens // self.seq_len, finished

    def wait_for_final(self, timeout: float | None = None) -> int:
        """Wait for the build to finish; return the total number of examples."""
        if not self.reader.finished:
            self.reader.wait_until(lambda: self.reader.finished, timeout, "the build to finish")
        return self.num_examples_available()

    def wait_for_examples(self, count: int, timeout: float | None = None) -> None:
        """Wait until `count` examples are committed (IndexError if the finished cache has fewer)."""
        if self.num_examples_available() >= count:
            return
        self.reader.wait_until(lambda: self.num_examples_available() >= count, timeout, f"{count} examples")

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> np.ndarray:
        """Examples at global `indices` as an int32 array [len(indices), seq_len]; waits for uncommitted ones."""
        indices = committed_indices(self, indices, timeout)
        out = np.empty((len(indices), self.seq_len), dtype=np.int32)
        for row in np.argsort(indices, kind="stable"):  # sorted: neighbouring examples share chunks
            start = int(indices[row]) * self.seq_len
            out[row] = self.reader.tokens(start, start + self.seq_len)
        return out

    def chunks_needed(self, indices: Sequence[int] | np.ndarray) -> set[tuple[int, int]]:
        """The (shard, chunk) pairs that examples at `indices` come from."""
        needed: set[tuple[int, int]] = set()
        for index in np.asarray(indices, dtype=np.int64).reshape(-1):
            start = int(index) * self.seq_len
            needed.update(self.reader.chunks_for_tokens(start, start + self.seq_len))
        return needed

    def iter_batches(
        self,
        batch_size: int,
        *,
        process_index: int = 0,
        process_count: int = 1,
        timeout: float | None = None,
    ) -> Iterator[np.ndarray]:
        """One unshuffled pass (for validation): this process's slice of each full global batch, in order."""
        return iter_global_batches(self, batch_size, process_index, process_count, timeout)

    def shuffled(self, seed: int, timeout: float | None = None) -> PermutedExamples:
        """A full permutation of all examples keyed by `seed`; waits for the build to finish (its size)."""
        total = self.wait_for_final(timeout)
        if total == 0:
            raise IndexError(f"{self.reader.url}: the cache has no example of {self.seq_len} tokens.")
        return PermutedExamples(self, FeistelPermutation(total, seed))

    def era_shuffled(self, seed: int, era_length: int, spread: int = SPREAD_ERAS) -> EraShuffledExamples:
        """Shuffled in eras of `era_length` examples that each mix the last `spread` eras of the stream (see
        `EraShuffle`): usable while the cache is still being built, and the same order whenever it is read."""
        return EraShuffledExamples(self, EraShuffle(seed, era_length, spread))


class PermutedExamples:
    """Examples in the order of a full permutation; index n*e + j is position j of epoch e's permutation."""

    def __init__(self, base: TokenWindows, permutation: FeistelPermutation):
        self.base = base
        self.permutation = permutation
        self.seq_len = base.seq_len
        self._epochs: dict[int, FeistelPermutation] = {0: permutation}

    def __len__(self) -> int:
        return self.permutation.n

    def _epoch(self, epoch: int) -> FeistelPermutation:
        if epoch not in self._epochs:  # each epoch gets its own order, still a pure function of the seed
            self._epochs[epoch] = FeistelPermutation(self.permutation.n, self.permutation.seed * 1_000_003 + epoch)
        return self._epochs[epoch]

    def example_indices(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The unshuffled example index at each shuffled position (past the end: later epochs)."""
        indices = global_indices(indices)
        n = self.permutation.n
        examples = np.empty_like(indices)
        epochs = indices // n
        for epoch in np.unique(epochs):
            where = epochs == epoch
            examples[where] = self._epoch(int(epoch))(indices[where] % n)
        return examples

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> np.ndarray:
        """Examples at shuffled positions `indices` (past the end: later epochs) as int32 [n, seq_len]."""
        return self.base.get_batch(self.example_indices(indices), timeout)


class EraShuffledExamples:
    """Examples in the order of an `EraShuffle`: usable while the cache grows, each era once it is committed.

    `base` is any view that says how many of its examples are committed (`committed_examples()`) and fetches
    them by index: TokenWindows, or PackedSequences (whose `get_batch` gives a dict of arrays)."""

    def __init__(self, base: TokenWindows, shuffle: EraShuffle):
        self.base = base
        self.shuffle = shuffle
        self.seq_len = base.seq_len
        self._lock = threading.Lock()  # a prefetch thread and the training loop may share one view

    def _laid_out(self, count: int) -> bool:
        """Lay out the eras that the committed examples determine; whether the first `count` positions are."""
        with self._lock:
            if self.shuffle.covered < count and not self.shuffle.complete:
                committed, finished = self.base.committed_examples()
                self.shuffle.extend(committed, committed if finished else None)
            return self.shuffle.covered >= count

    def example_indices(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> np.ndarray:
        """The unshuffled example index at each shuffled position; waits for their eras to be committed."""
        indices = global_indices(indices)
        if len(indices) == 0:
            return indices
        wanted = int(indices.max()) + 1
        if not self._laid_out(wanted):
            what = f"the shuffled era of example {wanted - 1}"
            self.base.reader.wait_until(lambda: self._laid_out(wanted), timeout, what)
        with self._lock:
            return self.shuffle(indices)

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> np.ndarray:
        """Examples at shuffled positions `indices` as int32 [n, seq_len]; waits for their eras to commit."""
        return self.base.get_batch(self.example_indices(indices, timeout), timeout)


class Documents:
    """Examples are whole documents (their tokens, EOS included)."""

    def __init__(self, reader: CommittedCache):
        self.reader = reader

    def num_available(self) -> int:
        return self.reader.num_docs

    def get(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> list[np.ndarray]:
        """Token arrays of the documents at global `indices`; waits for uncommitted ones."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(indices) == 0:
            return []
        wanted = int(indices.max()) + 1
        if self.reader.num_docs < wanted:
            self.reader.wait_until(lambda: self.reader.num_docs >= wanted, timeout, f"{wanted} documents")
        return [self.reader.document(int(i)) for i in indices]
