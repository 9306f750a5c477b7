"""Examples per step, one size or sizes that change at given steps, and where each step's examples start.

Step s reads the global positions [offset(s), offset(s) + size_at(s)), where offset(s) is the sum of the sizes of
the steps before it: a schedule cuts the same sequence of examples into batches of other sizes, and a resumed run
finds its place from the step alone. The shape is Levanter's `train_batch_size: [{start, value}, ...]`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


class BatchSchedule:
    """Examples per step: `sizes` is one size, or (start step, size) stages whose starts rise strictly from 0."""

    def __init__(self, sizes: int | Sequence[tuple[int, int]]):
        stages = [(0, sizes)] if isinstance(sizes, int) else [(start, value) for start, value in sizes]
        if not stages:
            raise ValueError("a batch schedule needs at least one stage, e.g. [(0, 32)].")
        for k, (start, value) in enumerate(stages):
            for what, number in (("start", start), ("size", value)):
                if isinstance(number, bool) or not isinstance(number, int | np.integer):
                    raise ValueError(f"batch schedule stage {k}: its {what} must be a whole number, not {number!r}.")
            if value < 1:
                raise ValueError(f"batch schedule stage {k}: its size must be at least 1, got {value}.")
            if k == 0 and start != 0:
                raise ValueError(f"the batch schedule's first stage must start at step 0, not {start}.")
            if k and start <= stages[k - 1][0]:
                raise ValueError(
                    f"stage {k} of the batch schedule starts at step {start}, not after stage {k - 1}'s "
                    f"{stages[k - 1][0]}: starts must rise strictly."
                )
        self.starts = tuple(int(s) for s, _ in stages)
        self.sizes = tuple(int(v) for _, v in stages)
        offsets = [0]
        for k in range(1, len(stages)):
            offsets.append(offsets[-1] + (self.starts[k] - self.starts[k - 1]) * self.sizes[k - 1])
        self.offsets = tuple(offsets)
        """Examples before each stage's first step."""

    def __repr__(self) -> str:
        if self.fixed is not None:
            return f"BatchSchedule({self.fixed})"
        return f"BatchSchedule({list(zip(self.starts, self.sizes, strict=True))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSchedule) and (self.starts, self.sizes) == (other.starts, other.sizes)

    def __hash__(self) -> int:
        return hash((self.starts, self.sizes))

    @property
    def fixed(self) -> int | None:
        """The size of every step when there is one stage, else None."""
        return self.sizes[0] if len(self.sizes) == 1 else None

    @property
    def distinct_sizes(self) -> tuple[int, ...]:
        """Every size the schedule uses, smallest first."""
        return tuple(sorted(set(self.sizes)))

    @property
    def largest(self) -> int:
        return max(self.sizes)

    def _stage(self, step: int) -> int:
        if step < 0:
            raise IndexError(f"steps are >= 0, got {step}.")
        return bisect.bisect_right(self.starts, step) - 1

    def size_at(self, step: int) -> int:
        """Examples in step `step`'s global batch."""
        return self.sizes[self._stage(step)]

    def offset(self, step: int) -> int:
        """The global position of step `step`'s first example: the examples of steps [0, step)."""
        k = self._stage(step)
        return self.offsets[k] + (step - self.starts[k]) * self.sizes[k]

    def step_of(self, position: int) -> int:
        """The step whose batch holds global position `position`."""
        if position < 0:
            raise IndexError(f"positions are >= 0, got {position}.")
        k = bisect.bisect_right(self.offsets, position) - 1
        return self.starts[k] + (position - self.offsets[k]) // self.sizes[k]

    def positions(self, step: int) -> np.ndarray:
        """The global positions of step `step`'s batch."""
        start = self.offset(step)
        return np.arange(start, start + self.size_at(step), dtype=np.int64)


def as_batch_schedule(batch_size: int | BatchSchedule) -> BatchSchedule:
    """A schedule from a fixed size (checked to be a whole number >= 1) or a schedule itself."""
    if isinstance(batch_size, BatchSchedule):
        return batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number of examples >= 1, got {batch_size!r}.")
    return BatchSchedule(int(batch_size))
