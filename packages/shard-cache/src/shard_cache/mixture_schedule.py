"""Mixture weights: Levanter's `train_weights` ({name: weight} or [[step, {name: weight}], ...]), checked.

A `MixtureSchedule` is a value: the sources' names and, per stage, the step it starts at and its weights
(normalised). The per-block example counts are fixed by the weights with largest-remainder rounding, in exact
rational arithmetic, so that they are the same on every machine.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from shard_cache.errors import ShardCacheError

STOP_STRATEGIES = ("restart", "first_exhausted")
DEFAULT_BLOCK_SIZE = 2048


class MixtureConfigError(ShardCacheError, ValueError):
    """Mixture settings (weights, stages, block size, stop strategy) that cannot be used."""


@dataclass(frozen=True)
class MixtureSchedule:
    """Every source's name (sorted) and the weight stages: `starts[k]` is the first step of stage k."""

    names: tuple[str, ...]
    starts: tuple[int, ...]
    exact: tuple[tuple[Fraction, ...], ...]  # normalised weights per stage, aligned with `names`

    def __repr__(self) -> str:
        stages = ", ".join(f"[{start}, {self.stage_weights(k)}]" for k, start in enumerate(self.starts))
        return f"MixtureSchedule(names={self.names}, stages=[{stages}])"

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_at(self, step: int) -> int:
        """The index of the stage in force at `step`."""
        if step < 0:
            raise ValueError(f"steps are >= 0, got {step}.")
        return sum(1 for start in self.starts[1:] if start <= step)

    def weights_at(self, step: int) -> dict[str, float]:
        """The normalised weight of every source at `step` (0 for a source not trained on then)."""
        return dict(zip(self.names, map(float, self.exact[self.stage_at(step)]), strict=True))

    def stage_weights(self, stage: int) -> dict[str, float]:
        return dict(zip(self.names, map(float, self.exact[stage]), strict=True))

    def trained(self) -> tuple[str, ...]:
        """Names with a positive weight in some stage (the others are evaluation-only)."""
        return tuple(n for i, n in enumerate(self.names) if any(w[i] > 0 for w in self.exact))

    def evaluation_only(self) -> tuple[str, ...]:
        """Names whose weight is 0 in every stage."""
        trained = set(self.trained())
        return tuple(n for n in self.names if n not in trained)

    def with_stage(self, step: int, weights: Mapping[str, float], *, key: str = "weights") -> MixtureSchedule:
        """This schedule plus a stage from `step` on (after the last one): how weights change during a run.

        Nothing before `step` changes, so a run that appends stages as it goes (adaptive weights) keeps the
        order it has already trained on.
        """
        if not _is_whole(step) or step <= self.starts[-1]:
            raise MixtureConfigError(
                f"{key}: a new stage must start after the last one (step {self.starts[-1]}), got step {step!r}."
            )
        exact = _normalise(weights, self.names, key)
        return MixtureSchedule(self.names, (*self.starts, int(step)), (*self.exact, exact))

    def as_config(self) -> dict[str, float] | list[list[Any]]:
        """The schedule in `train_weights` form (a plain dict for one stage), for writing back as YAML."""
        stages = [[start, self.stage_weights(k)] for k, start in enumerate(self.starts)]
        return stages[0][1] if len(stages) == 1 else stages

    def block_counts(self, stage: int, block_size: int) -> tuple[int, ...]:
        """Examples drawn from each source in one block of `block_size` during `stage` (they sum to it)."""
        return largest_remainder(self.exact[stage], block_size)


def largest_remainder(weights: Sequence[Fraction], total: int) -> tuple[int, ...]:
    """Integer shares of `total` proportional to `weights` (summing to 1): floors, then the largest remainders.

    Ties go to the earlier entry, so the result is a pure function of its arguments.
    """
    quotas = [w * total for w in weights]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return tuple(counts)


def parse_train_weights(
    value: Any,
    sources: Iterable[str],
    *,
    key: str = "data.train_weights",
    block_size: int | None = None,
) -> MixtureSchedule:
    """Check and normalise `train_weights` against the source names; MixtureConfigError names the bad key.

    `value`: {name: weight}, or stages [[step, {name: weight}], ...] starting at step 0 in increasing order;
    None gives every source the same weight. A source left out of a stage has weight 0 in it; a source whose
    weight is 0 in every stage is evaluation-only. With `block_size`, a source whose positive weight is too
    small to get one example per block is warned about.
    """
    names = tuple(sorted(sources))
    if not names:
        raise MixtureConfigError(f"{key}: there are no sources to weight; define at least one data source.")
    if len(set(names)) != len(names):
        raise MixtureConfigError(f"{key}: the source names {list(names)} repeat a name; give each a unique one.")
    if value is None:
        value = {name: 1.0 for name in names}
    if isinstance(value, Mapping):
        stages = [(0, value, key)]
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        if not value:
            raise MixtureConfigError(
                f"{key}: the list of stages is empty; give {{source: weight}} or [[0, {{source: weight}}], ...]."
            )
        stages = [_stage(entry, f"{key}[{k}]") for k, entry in enumerate(value)]
    else:
        raise MixtureConfigError(
            f"{key}: expected {{source: weight}} or a list of [step, {{source: weight}}] stages, got {value!r}."
        )
    starts: list[int] = []
    exact: list[tuple[Fraction, ...]] = []
    for k, (start, weights, where) in enumerate(stages):
        if k == 0 and start != 0:
            raise MixtureConfigError(
                f"{where}: the first stage starts at step {start}, but the weights must be defined from step 0. "
                "Start the first stage at 0 (or add a stage [0, {...}] before it)."
            )
        if k > 0 and start <= starts[-1]:
            raise MixtureConfigError(
                f"{where}: this stage starts at step {start}, not after the previous stage's step {starts[-1]}. "
                "List the stages in strictly increasing step order."
            )
        starts.append(start)
        exact.append(_normalise(weights, names, where))
    schedule = MixtureSchedule(names, tuple(starts), tuple(exact))
    if block_size is not None:
        _warn_starved(schedule, parse_block_size(block_size), [where for _, _, where in stages])
    return schedule


def parse_block_size(value: Any, *, key: str = "data.mixture_block_size") -> int:
    """Check `mixture_block_size`: a whole number of examples >= 1."""
    if not _is_whole(value) or value < 1:
        raise MixtureConfigError(
            f"{key}: must be a whole number of examples >= 1 (default {DEFAULT_BLOCK_SIZE}), got {value!r}."
        )
    return int(value)


def parse_stop_strategy(value: Any, *, key: str = "data.stop_strategy") -> str:
    """Check `stop_strategy`: 'restart' (wrap exhausted sources) or 'first_exhausted' (stop at the first)."""
    if value not in STOP_STRATEGIES:
        raise MixtureConfigError(
            f"{key}: {value!r} is not a stop strategy here; use 'restart' (a source that runs out starts over) "
            "or 'first_exhausted' (training data ends when the first source runs out)."
        )
    return value


def _stage(entry: Any, where: str) -> tuple[int, Any, str]:
    if (
        not isinstance(entry, Sequence)
        or isinstance(entry, str | bytes)
        or len(entry) != 2
        or not isinstance(entry[1], Mapping)
    ):
        raise MixtureConfigError(f"{where}: a stage is [step, {{source: weight, ...}}], got {entry!r}.")
    step = entry[0]
    if not _is_whole(step) or step < 0:
        raise MixtureConfigError(f"{where}[0]: a stage's step must be a whole number >= 0, got {step!r}.")
    return int(step), entry[1], where


def _is_whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _normalise(weights: Mapping[str, Any], names: tuple[str, ...], where: str) -> tuple[Fraction, ...]:
    exact = dict.fromkeys(names, Fraction(0))
    for name, weight in weights.items():
        if name not in exact:
            raise MixtureConfigError(
                f"{where}.{name}: there is no source named {name!r}; the sources are {', '.join(names)}. Fix the "
                "name, or define that source."
            )
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise MixtureConfigError(f"{where}.{name}: the weight must be a finite number >= 0, got {weight!r}.")
        if weight < 0:
            raise MixtureConfigError(
                f"{where}.{name}: the weight {weight} is negative. Weights are shares of the training examples: "
                "use a number >= 0 (0 keeps the source for evaluation only)."
            )
        exact[name] = Fraction(weight) if isinstance(weight, int) else Fraction(float(weight))
    total = sum(exact.values())
    if total == 0:
        raise MixtureConfigError(
            f"{where}: every weight is 0, so no source would be trained on. Give at least one source a positive "
            "weight (the weights are normalised to sum to 1)."
        )
    return tuple(exact[n] / total for n in names)


def _warn_starved(schedule: MixtureSchedule, block_size: int, wheres: list[str]) -> None:
    for k, where in enumerate(wheres):
        counts = schedule.block_counts(k, block_size)
        for name, weight, count in zip(schedule.names, schedule.exact[k], counts, strict=True):
            if weight > 0 and count == 0:
                warnings.warn(
                    f"{where}.{name}: the weight {float(weight):.3g} is too small to draw one example per mixture "
                    f"block of {block_size}, so this source is never trained on in that stage. Raise "
                    "mixture_block_size (or the weight).",
                    stacklevel=3,
                )
