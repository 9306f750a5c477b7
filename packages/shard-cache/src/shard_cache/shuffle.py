"""Seeded index permutations: a full Feistel permutation over [0, n), and an era shuffle for a growing cache."""

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


class EraShuffle:
    """Shuffles within consecutive eras of `era_length` examples, so it works while the cache still grows.

    Era k (examples [k*E, (k+1)*E)) is permuted by its own key once it is complete; the last, partial era is
    permuted once the final number of examples is known.
    """

    def __init__(self, seed: int, era_length: int):
        if era_length < 1:
            raise ValueError(f"era_length must be at least 1, got {era_length}.")
        self.seed = int(seed)
        self.era_length = int(era_length)
        self._cache: dict[tuple[int, int], FeistelPermutation] = {}

    def _perm(self, era: int, size: int) -> FeistelPermutation:
        key = (era, size)
        if key not in self._cache:
            self._cache[key] = FeistelPermutation(size, _mix64(_mix64(self.seed) ^ era))
        return self._cache[key]

    def __call__(self, indices: np.ndarray, final_n: int | None) -> np.ndarray:
        """Map indices to examples; an index in the last partial era needs `final_n` (else IndexError)."""
        x = np.asarray(indices, dtype=np.int64)
        out = np.empty_like(x)
        eras = x // self.era_length
        for era in np.unique(eras):
            start = int(era) * self.era_length
            size = self.era_length
            if final_n is not None and start + size > final_n:
                size = final_n - start
            where = eras == era
            if size <= 0 or (final_n is not None and x[where].max() >= final_n):
                raise IndexError(f"example index out of range: the cache has {final_n} examples.")
            out[where] = start + self._perm(int(era), size)(x[where] - start)
        return out
