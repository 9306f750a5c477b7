"""Weighted, staged mixtures of example sources: each step's batch drawn from several caches by a fixed plan.

The plan (`MixtureLayout`) says which source and which of its examples fills each global position; this module
fetches them. A source is any view that can be asked for examples at global positions while it may still be
growing (`ExampleSource`: `TokenWindows` and its shuffled views). Pure data logic: no jax.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shard_cache.batch_schedule import BatchSchedule
from shard_cache.errors import ShardCacheError
from shard_cache.examples import process_slice
from shard_cache.mixture_layout import MixtureLayout
from shard_cache.mixture_schedule import DEFAULT_BLOCK_SIZE, parse_stop_strategy, parse_train_weights


@runtime_checkable
class ExampleSource(Protocol):
    """Examples at global positions [0, n) of seq_len tokens each, where n may grow until the source is final."""

    seq_len: int

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> np.ndarray:
        """Examples at `indices` as int32 [len(indices), seq_len] (or a dict of such fields, for packed or
        padded documents); waits for uncommitted ones, IndexError past the end of a final source."""
        ...

    def wait_for_examples(self, count: int, timeout: float | None = None) -> None:
        """Return once `count` examples exist; IndexError if the source became final with fewer."""
        ...

    def final_num_examples(self) -> int | None:
        """The number of examples once the source is final, else None."""
        ...


class _OrderedView:
    """A reordering view (era-shuffled, permuted) whose size is that of the `base` windows it reorders."""

    def __init__(self, view: Any, base: ExampleSource):
        self.view = view
        self.base = base
        self.seq_len = base.seq_len

    def get_batch(self, indices: Sequence[int] | np.ndarray, timeout: float | None = None) -> np.ndarray:
        return self.view.get_batch(indices, timeout)

    def wait_for_examples(self, count: int, timeout: float | None = None) -> None:
        self.base.wait_for_examples(count, timeout)

    def final_num_examples(self) -> int | None:
        return self.base.final_num_examples()


def example_source(view: Any) -> ExampleSource:
    """`view` as an ExampleSource: as it is, or a reordering view of one through its `base` (shuffled views)."""
    if isinstance(view, ExampleSource):
        return view
    base = getattr(view, "base", None)
    if callable(getattr(view, "get_batch", None)) and isinstance(base, ExampleSource):
        return _OrderedView(view, base)
    raise TypeError(
        f"{type(view).__name__} is not an example source: a mixture needs seq_len, get_batch(indices, timeout), "
        "wait_for_examples(count, timeout) and final_num_examples() (TokenWindows has them; its shuffled and "
        "era-shuffled views are taken through their `base`)."
    )


class MixtureExhaustedError(ShardCacheError):
    """The mixture has run out (stop_strategy 'first_exhausted'): `step` is the first step it cannot fill."""

    def __init__(self, message: str, *, step: int, source: str, num_examples: int):
        super().__init__(message)
        self.step = step
        self.source = source
        self.num_examples = num_examples


class MixtureExamples:
    """Examples of a mixture at global positions, fetched from the sources that the layout assigns them to.

    stop_strategy 'restart': a source that runs out starts over (index modulo its final size; while it still
    grows, a lookup past its end waits for the build). 'first_exhausted': the mixture ends at the first step
    that would need an example past the end of a source, with `MixtureExhaustedError`; to agree on that step, every
    reader checks each source's draws up to the end of the whole global batch, not only of its own slice (and
    waits where the step's examples are not committed yet).
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        layout: MixtureLayout,
        *,
        stop_strategy: str = "restart",
        timeout: float | None = None,
    ):
        self.layout = layout
        self.names = layout.names
        self.stop_strategy = parse_stop_strategy(stop_strategy, key="stop_strategy")
        self.timeout = timeout
        unknown = sorted(set(sources) - set(self.names))
        if unknown:
            raise ShardCacheError(
                f"mixture sources {unknown} have no weight in the schedule, whose sources are {list(self.names)}."
            )
        missing = [n for n in layout.schedule.trained() if n not in sources]
        if missing:
            raise ShardCacheError(f"the mixture's schedule trains on {missing}, but no example source was given.")
        self._sources: list[ExampleSource | None] = [
            example_source(sources[n]) if n in sources else None for n in self.names
        ]
        self._finals: list[int | None] = [None] * len(self.names)
        lengths = {n: s.seq_len for n, s in zip(self.names, self._sources, strict=True) if s is not None}
        if len(set(lengths.values())) != 1:
            raise ShardCacheError(
                f"the mixture's sources have different example lengths {lengths}; give every source the same seq_len."
            )
        self.seq_len = next(iter(lengths.values()))

    # ---- batches ----
    def batch(
        self, step: int, *, process_index: int = 0, process_count: int = 1, timeout: float | None = None
    ) -> np.ndarray:
        """This process's slice of step `step`'s global batch, as int32 [batch_size / process_count, seq_len]
        (a dict of such fields where the sources give fields)."""
        return self.step_rows(step, *self._slice(step, process_index, process_count), timeout=timeout)

    def step_rows(self, step: int, start: int, stop: int, *, timeout: float | None = None) -> np.ndarray:
        """Rows [start, stop) of step `step`'s global batch (a reader's share of it, which may be shorter than an
        equal slice, or empty); with stop_strategy 'first_exhausted' every reader checks the whole global batch."""
        timeout = self.timeout if timeout is None else timeout
        size = self.layout.batches.size_at(step)
        if not 0 <= start <= stop <= size:
            raise IndexError(f"rows [{start}, {stop}) are not within step {step}'s batch of {size} examples.")
        if self.stop_strategy == "first_exhausted":
            self._check_available(self.layout.batches.offset(step + 1), timeout)  # the global batch, not the rows
        first = self.layout.batches.offset(step)
        return self._fetch_located(*self.layout.locate_range(first + start, first + stop), timeout)

    def get_batch(self, positions: Sequence[int] | np.ndarray, timeout: float | None = None) -> np.ndarray:
        """Examples at global mixture `positions` as int32 [len(positions), seq_len]."""
        timeout = self.timeout if timeout is None else timeout
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if self.stop_strategy == "first_exhausted" and len(positions):
            self._check_available(int(positions.max()) + 1, timeout)
        return self._fetch_located(*self.layout.locate(positions), timeout)

    def source_ids(self, step: int, *, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """The source number (an index into `names`) of each example of this process's slice of `step`."""
        start, stop = self._slice(step, process_index, process_count)
        first = self.layout.batches.offset(step)
        return self.layout.locate_range(first + start, first + stop)[0]

    def _slice(self, step: int, process_index: int, process_count: int) -> tuple[int, int]:
        """The [start, stop) of the rows of `step`'s global batch that one process reads, as `process_slice`."""
        batch = self.layout.batches.size_at(step)  # raises for a negative step
        if not 0 <= process_index < process_count or batch % process_count:
            process_slice(np.arange(batch), process_index, process_count)  # raises its error
        per = batch // process_count
        return process_index * per, (process_index + 1) * per

    def _fetch_located(self, sources: np.ndarray, indices: np.ndarray, timeout: float | None) -> Any:
        by_source = np.argsort(sources, kind="stable")  # one request per source, in position order
        parts, start = [], 0
        for s, end in enumerate(np.bincount(sources, minlength=len(self.names)).cumsum().tolist()):
            if end > start:
                rows = by_source[start:end]
                parts.append((rows, self._fetch(s, indices[rows], timeout)))
            start = end
        if parts and isinstance(parts[0][1], dict):  # sources of whole documents give a dict of fields
            fields = parts[0][1]
            return {k: _scatter(len(sources), [(r, p[k]) for r, p in parts], fields[k].dtype) for k in fields}
        out = np.empty((len(sources), self.seq_len), dtype=np.int32)
        for rows, part in parts:
            out[rows] = part
        return out

    def _fetch(self, s: int, indices: np.ndarray, timeout: float | None) -> np.ndarray:
        source = self._sources[s]
        assert source is not None, "the layout never draws from a source without weight"
        final = self._final(s)
        if final is not None and self.stop_strategy == "restart":
            indices = self._wrap(s, indices, final)
        try:
            return source.get_batch(indices, timeout)
        except IndexError:
            final = self._final(s)
            if final is None:
                raise
            if self.stop_strategy == "restart":  # became final while we asked: wrap what lies past its end
                return source.get_batch(self._wrap(s, indices, final), timeout)
            raise self._exhausted({s: final}) from None

    def _final(self, s: int) -> int | None:
        """The final size of source `s`, or None while it may grow (remembered once known: it cannot change)."""
        final = self._finals[s]
        if final is None:
            source = self._sources[s]
            final = self._finals[s] = None if source is None else source.final_num_examples()
        return final

    def _wrap(self, s: int, indices: np.ndarray, final: int) -> np.ndarray:
        if final == 0:
            raise ShardCacheError(
                f"mixture source {self.names[s]!r} is finished and holds no example of {self.seq_len} tokens, so it "
                "cannot be drawn from. Give it weight 0, or check its inputs."
            )
        return indices % final

    # ---- first_exhausted ----
    def _check_available(self, end: int, timeout: float | None) -> None:
        """Raise MixtureExhaustedError if positions [0, end) need more examples of a source than it has."""
        short: dict[int, int] = {}
        for s, needed in enumerate(self.layout.draws_before(end)):
            source = self._sources[s]
            if needed == 0 or source is None:
                continue
            final = self._final(s)
            if final is None:
                try:
                    source.wait_for_examples(int(needed), timeout)
                    continue
                except IndexError:
                    final = self._final(s)
                    if final is None:
                        raise
            if needed > final:
                short[s] = final
        if short:
            raise self._exhausted(short)

    def _exhausted(self, short: dict[int, int]) -> MixtureExhaustedError:
        ends: dict[int, int] = {}
        for s, final in short.items():
            position = self.layout.position_of_draw(s, final)
            # short holds sources that positions before `end` draw more than `final` examples from: draw `final` happens
            assert position is not None, f"source {s} never draws example {final}"
            ends[s] = self.layout.batches.step_of(position)
        step, s = min((end, s) for s, end in ends.items())
        final = short[s]
        complete = f"Steps 0-{step - 1} are complete." if step else "No step can be filled."
        return MixtureExhaustedError(
            f"the mixture is exhausted at step {step}: source {self.names[s]!r} has {final} examples of "
            f"{self.seq_len} tokens, and step {step}'s batch needs more (stop_strategy 'first_exhausted'). "
            f"{complete} Train for fewer steps, add data to that source, or use stop_strategy 'restart' to start "
            "exhausted sources over.",
            step=step,
            source=self.names[s],
            num_examples=final,
        )

    def exhaustion_step(self) -> int | None:
        """The step at which the mixture ends, from the sources that are final so far (None: not known, or
        stop_strategy 'restart')."""
        if self.stop_strategy == "restart":
            return None
        steps = []
        for s in range(len(self.names)):
            final = self._final(s)
            position = None if final is None else self.layout.position_of_draw(s, final)
            if position is not None:
                steps.append(self.layout.batches.step_of(position))
        return min(steps, default=None)

    # ---- accounting ----
    def examples_seen(self, step: int) -> dict[str, int]:
        """Examples drawn from each source by steps [0, step) (repeats of a restarted source included)."""
        return self.layout.examples_seen(step)

    def tokens_seen(self, step: int) -> dict[str, int]:
        """Tokens drawn from each source by steps [0, step): for `data/<name>/tokens_seen`."""
        return {n: count * self.seq_len for n, count in self.examples_seen(step).items()}

    def weights_at(self, step: int) -> dict[str, float]:
        """The normalised weight of each source in force at `step`: for `data/<name>/weight`."""
        return self.layout.schedule.weights_at(step)


def _scatter(count: int, parts: list[tuple[np.ndarray, np.ndarray]], dtype: Any) -> np.ndarray:
    """One array of `count` rows of `dtype`, each part's rows at its positions."""
    out = np.empty((count, *parts[0][1].shape[1:]), dtype=dtype)
    for rows, part in parts:
        out[rows] = part
    return out


def mixture_examples(
    sources: Mapping[str, Any],
    train_weights: Any,
    *,
    batch_size: int | BatchSchedule,
    seed: int = 0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stop_strategy: str = "restart",
    timeout: float | None = None,
) -> MixtureExamples:
    """A mixture of `sources` (name -> example source) weighted by `train_weights` ({name: w} or stages)."""
    schedule = parse_train_weights(train_weights, list(sources), key="train_weights", block_size=block_size)
    layout = MixtureLayout(schedule, batch_size=batch_size, block_size=block_size, seed=seed)
    return MixtureExamples(sources, layout, stop_strategy=stop_strategy, timeout=timeout)
