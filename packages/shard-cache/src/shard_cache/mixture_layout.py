"""Where each global example position of a mixture comes from: (source, index in that source), in closed form.

Stage k of the schedule covers positions [offset(starts[k]), offset(starts[k+1])), offset(s) being the examples of
the steps before s (s * batch_size at a fixed size; the batch schedule's sum otherwise). Inside a stage,
blocks of `block_size` consecutive positions start at the stage's first position, so a stage change takes effect
at exactly its step. A block draws a fixed count from each source (the schedule's largest-remainder counts)
in the order of a seeded permutation of its slots; the block that a stage boundary cuts short is the prefix of
the full block it would have been, so appending a stage never changes a position before it. Each source's
examples are drawn in its own order, 0, 1, 2, ...: the index of a draw is the number of draws of that source
before it, computed from closed-form counts at the block's start, with no replay.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from shard_cache.batch_schedule import BatchSchedule, as_batch_schedule
from shard_cache.mixture_schedule import DEFAULT_BLOCK_SIZE, MixtureSchedule, parse_block_size
from shard_cache.shuffle import FeistelPermutation


def _block_seed(seed: int, stage: int, block: int) -> int:
    """A 64-bit key for one block's permutation, the same on every machine and Python."""
    digest = hashlib.blake2b(f"shard-cache-mixture:{seed}:{stage}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class MixtureLayout:
    """The global sequence of (source, index) of a weight schedule: a pure function of (schedule, batch size or
    batch schedule, block size, seed) and of the position, the same for any number of readers and across resumes."""

    def __init__(
        self,
        schedule: MixtureSchedule,
        *,
        batch_size: int | BatchSchedule,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int = 0,
        cached_blocks: int = 16,
    ):
        self.batches = as_batch_schedule(batch_size)
        self.schedule = schedule
        self.names = schedule.names
        self.batch_size = self.batches.fixed
        """The size of every step; None under a batch schedule of several sizes (see `batches`)."""
        self.block_size = parse_block_size(block_size, key="block_size")
        self.seed = int(seed)
        self._cached_blocks = cached_blocks
        self._blocks: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()  # a prefetch thread and the training loop may share one layout
        sources = len(self.names)
        self._stage_start_list = [self.batches.offset(s) for s in schedule.starts]
        self._stage_starts = np.array(self._stage_start_list, dtype=np.int64)
        # per stage: draws of each source in a full block, and where each source's slots start in a block
        self._counts = np.array([schedule.block_counts(k, self.block_size) for k in range(schedule.num_stages)])
        self._counts = self._counts.astype(np.int64).reshape(schedule.num_stages, sources)
        self._slot_starts = np.cumsum(self._counts, axis=1) - self._counts
        self._slots = [np.repeat(np.arange(sources, dtype=np.int32), c) for c in self._counts]
        # draws of each source before each stage's first position
        self._before = np.zeros((schedule.num_stages, sources), dtype=np.int64)
        for k in range(schedule.num_stages - 1):
            full, partial = divmod(int(self._stage_starts[k + 1] - self._stage_starts[k]), self.block_size)
            drawn = full * self._counts[k]
            if partial:
                drawn = drawn + np.bincount(self._block(k, full)[0][:partial], minlength=sources)
            self._before[k + 1] = self._before[k] + drawn

    # ---- blocks ----
    def _block(self, stage: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of each slot of a block, and each slot's rank among the block's draws of its source."""
        key = (stage, block)
        with self._lock:
            cached = self._blocks.get(key)
            if cached is not None:
                self._blocks.move_to_end(key)
                return cached
        size = self.block_size
        order = FeistelPermutation(size, _block_seed(self.seed, stage, block))(np.arange(size))
        source = self._slots[stage][order]
        by_source = np.argsort(source, kind="stable")  # a source's slots, in position order
        rank = np.empty(size, dtype=np.int64)
        rank[by_source] = np.arange(size) - self._slot_starts[stage][source[by_source]]
        source.setflags(write=False)  # shared by every lookup (and handed out as views): never written
        rank.setflags(write=False)
        with self._lock:
            self._blocks[key] = (source, rank)
            if len(self._blocks) > self._cached_blocks:
                self._blocks.popitem(last=False)
        return source, rank

    def _where(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Stage, block within the stage, and offset within the block, of each position."""
        stage = np.searchsorted(self._stage_starts, positions, side="right") - 1
        block, offset = np.divmod(positions - self._stage_starts[stage], self.block_size)
        return stage, block, offset

    # ---- lookups ----
    def locate(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source number, index within that source) of each global position; sources number as `names`."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(positions) == 0:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
        low, high = int(positions.min()), int(positions.max())
        if low < 0:
            raise IndexError(f"mixture positions must be >= 0, got {low}.")
        stage = bisect.bisect_right(self._stage_start_list, low) - 1
        block = (low - self._stage_start_list[stage]) // self.block_size
        block_start = self._stage_start_list[stage] + block * self.block_size
        if high < block_start + self.block_size and bisect.bisect_right(self._stage_start_list, high) - 1 == stage:
            return self._locate_in_block(stage, block, positions - block_start)  # a step's batch, mostly
        sources = np.empty(len(positions), dtype=np.int32)
        indices = np.empty(len(positions), dtype=np.int64)
        stages, blocks, offsets = self._where(positions)
        for k in np.unique(stages):
            in_stage = stages == k
            for j in np.unique(blocks[in_stage]):
                here = in_stage & (blocks == j)
                sources[here], indices[here] = self._locate_in_block(int(k), int(j), offsets[here])
        return sources, indices

    def locate_range(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """`locate(range(start, stop))`, faster when the range lies in one block (as a step's slice mostly does)."""
        if 0 <= start < stop:
            stage = bisect.bisect_right(self._stage_start_list, start) - 1
            block = (start - self._stage_start_list[stage]) // self.block_size
            block_start = self._stage_start_list[stage] + block * self.block_size
            next_stage = self._stage_start_list[stage + 1] if stage + 1 < len(self._stage_start_list) else stop
            if stop <= min(block_start + self.block_size, next_stage):
                return self._locate_in_block(stage, block, slice(start - block_start, stop - block_start))
        return self.locate(np.arange(start, stop, dtype=np.int64))

    def _locate_in_block(self, stage: int, block: int, offsets: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray]:
        block_sources, block_ranks = self._block(stage, block)
        sources = block_sources[offsets]
        first = self._before[stage] + block * self._counts[stage]  # each source's index at the block's start
        return sources, first[sources] + block_ranks[offsets]

    def draws_before(self, position: int) -> np.ndarray:
        """How many examples each source has given at positions [0, position), as int64 [len(names)]."""
        if position < 0:
            raise IndexError(f"mixture positions must be >= 0, got {position}.")
        stage, block, offset = (int(x[0]) for x in self._where(np.array([position], dtype=np.int64)))
        drawn = self._before[stage] + block * self._counts[stage]
        if offset:
            drawn = drawn + np.bincount(self._block(stage, block)[0][:offset], minlength=len(self.names))
        return drawn

    def position_of_draw(self, source: int, n: int) -> int | None:
        """The global position at which `source` gives its example n (0-based); None if it never does."""
        before = self._before[:, source]
        stage = int(np.searchsorted(before, n, side="right")) - 1  # the last stage that starts with <= n drawn
        count = int(self._counts[stage, source])
        if count == 0:
            return None  # only possible in the last stage: stages that draw nothing share the next one's start
        block, rank = divmod(n - int(before[stage]), count)
        slot = int(np.flatnonzero(self._block(stage, block)[0] == source)[rank])
        return int(self._stage_starts[stage]) + block * self.block_size + slot

    # ---- steps ----
    def step_positions(self, step: int) -> np.ndarray:
        """The global positions of one step's batch."""
        return self.batches.positions(step)

    def examples_seen(self, step: int) -> dict[str, int]:
        """Examples drawn from each source by steps [0, step)."""
        return dict(zip(self.names, map(int, self.draws_before(self.batches.offset(step))), strict=True))
