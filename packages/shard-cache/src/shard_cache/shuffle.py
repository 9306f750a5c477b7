"""Seeded index permutations: a full Feistel permutation over [0, n), and a window shuffle for a growing cache."""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64's finaliser on a Python int: a well-spread 64-bit key from a seed."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _mix64_array(values: np.ndarray) -> np.ndarray:
    """The same finaliser over a uint64 array (wrapping arithmetic)."""
    values = values ^ (values >> np.uint64(30))
    values = values * np.uint64(0xBF58476D1CE4E5B9)
    values = values ^ (values >> np.uint64(27))
    values = values * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


class FeistelPermutation:
    """A bijection of [0, n) keyed by `seed`: a balanced Feistel network over 2k bits, cycle-walked into range.

    Evaluating it needs no table, so any index maps in O(1) and the whole order is a pure function of (n, seed).
    """

    def __init__(self, n: int, seed: int, rounds: int = 6):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}.")
        self.n = int(n)
        self.seed = int(seed)
        self.half_bits = max(1, (max(1, (self.n - 1).bit_length()) + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._keys = [np.uint64(_mix64(_mix64(self.seed & _MASK64) + r)) for r in range(rounds)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix64_array(right ^ key) & self._mask)
        return (left << shift) | right

    def __call__(self, indices: np.ndarray | int) -> np.ndarray:
        """The permuted position of each index in [0, n)."""
        shape = np.shape(indices)
        x = np.atleast_1d(np.asarray(indices, dtype=np.int64)).reshape(-1)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"indices must lie in [0, {self.n}).")
        y = self._round_trip(x.astype(np.uint64))
        outside = y >= np.uint64(self.n)
        while outside.any():  # cycle-walk: the domain is at most 4n, so few steps are needed
            y[outside] = self._round_trip(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64).reshape(shape)


# How many eras each example may be put off by: an era of the shuffled order mixes the examples of the last
# SPREAD_ERAS eras of the stream, so a document's examples reach training over that many eras, not in one.
SPREAD_ERAS = 16


class EraShuffle:
    """The shuffled order of a cache that may still be growing, made of eras that overlap in what they draw from.

    The stream (the examples in the ledger's order) is cut into eras of `era_length`. Each example is put off by
    a pseudo-random number of eras, uniform in [0, `spread`), keyed by (seed, example): output era u holds the
    examples of stream eras u - spread + 1 ... u that landed on u, in a seeded permutation. So every era draws
    evenly from the last `spread` eras of the stream (from all of it, early on), each document's examples are
    spread over that many eras, and the mix drifts by 1/spread per era instead of changing at once. Output era
    u is laid out once stream era u is committed (or the build has finished): the order never depends on when
    a reader looked, and every example appears exactly once.
    """

    def __init__(self, seed: int, era_length: int, spread: int = SPREAD_ERAS):
        if era_length < 1:
            raise ValueError(f"era_length must be at least 1, got {era_length}.")
        if spread < 1:
            raise ValueError(f"spread must be at least 1, got {spread}.")
        self.seed = int(seed)
        self.era_length = int(era_length)
        self.spread = int(spread)
        self._delay_key = np.uint64(_mix64(_mix64(self.seed) ^ 0xDE1A7))
        self._counts = np.zeros(0, dtype=np.int64)  # examples landing on each output era, from counted stream eras
        self._counted = 0  # stream eras whose examples are in _counts
        self._starts = [0]  # first position of each laid-out output era, then the end of the last one
        self._total: int | None = None  # the number of examples, once the build has finished
        self._members: dict[int, np.ndarray] = {}  # a few recent output eras' examples, in example order

    @property
    def covered(self) -> int:
        """How many output positions are laid out so far."""
        return self._starts[-1]

    @property
    def complete(self) -> bool:
        """True once the whole stream is laid out (`covered` is then the number of examples)."""
        return self._total is not None and self.covered == self._total

    def era_starts(self) -> list[int]:
        """The first output position of each laid-out era, then where the last one ends."""
        return list(self._starts)

    def _delays(self, examples: np.ndarray) -> np.ndarray:
        """How many eras each example is put off by (integer arithmetic only: the same on every machine)."""
        mixed = _mix64_array(examples.astype(np.uint64) ^ self._delay_key)
        return (mixed % np.uint64(self.spread)).astype(np.int64)

    def _stream_era(self, v: int) -> np.ndarray:
        end = (v + 1) * self.era_length
        return np.arange(v * self.era_length, end if self._total is None else min(end, self._total), dtype=np.int64)

    def extend(self, committed: int, total: int | None) -> None:
        """Lay out every output era that `committed` complete examples determine (`total`: the final count, once
        the build has finished, else None)."""
        if self._total is not None or (total is None and committed < (self._counted + 1) * self.era_length):
            return
        self._total = None if total is None else int(total)
        eras = committed // self.era_length if total is None else -(-int(total) // self.era_length)
        if eras + self.spread > len(self._counts):
            self._counts = np.concatenate([self._counts, np.zeros(eras + self.spread - len(self._counts), np.int64)])
        for v in range(self._counted, eras):
            self._counts[v : v + self.spread] += np.bincount(self._delays(self._stream_era(v)), minlength=self.spread)
        self._counted = eras
        # output era u is final once every stream era that can land on it is counted
        fixed = eras if total is None else eras + self.spread - 1
        for u in range(len(self._starts) - 1, fixed):
            self._starts.append(self._starts[-1] + int(self._counts[u]))

    def members(self, u: int) -> np.ndarray:
        """The examples of output era `u` (laid out already), in increasing order."""
        if u not in self._members:
            parts = []
            for v in range(max(0, u - self.spread + 1), u + 1):
                examples = self._stream_era(v)
                parts.append(examples[self._delays(examples) == u - v])
            if len(self._members) >= 4:
                self._members.pop(next(iter(self._members)))
            self._members[u] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._members[u]

    def __call__(self, indices: np.ndarray | int) -> np.ndarray:
        """The example at each output position (IndexError for positions not laid out yet, or past the end)."""
        x = np.asarray(indices, dtype=np.int64)
        flat = x.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.covered):
            what = "the cache has" if self.complete else "the shuffle has laid out only"
            raise IndexError(f"example index out of range: {what} {self.covered} examples.")
        out = np.empty_like(flat)
        eras = np.searchsorted(self._starts, flat, side="right") - 1
        for u in np.unique(eras):
            where = eras == u
            members = self.members(int(u))
            permutation = FeistelPermutation(len(members), _mix64(_mix64(self.seed) ^ int(u)))
            out[where] = members[permutation(flat[where] - self._starts[u])]
        return out.reshape(x.shape)
