"""`trainer.train_batch_size` as Levanter writes it (a size, or `[{start, value}, ...]`), checked, as a schedule."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import shard_cache
from lm_train.errors import ConfigError

KEY = "trainer.train_batch_size"


@dataclass(frozen=True)
class ScheduleStep:
    """One stage of a batch-size schedule: from step `start` on, `value` examples per step (Levanter's keys)."""

    start: int
    """The first step of this stage (the first stage starts at 0; each later one after the one before)."""
    value: int
    """Examples per optimizer step from `start` until the next stage."""


_EXAMPLE = "e.g. [{start: 0, value: 256}, {start: 1000, value: 512}]"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_train_batch_size(value: Any) -> None:
    """A ConfigError naming the key and the fix unless `value` is a size >= 1 or a schedule of such stages."""
    if _whole(value):
        if value < 1:
            raise ConfigError(f"{KEY} must be at least 1, got {value}.")
        return
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ConfigError(
            f"{KEY} must be a number of examples per step or a list of {{start, value}} stages ({_EXAMPLE}), "
            f"got {value!r}."
        )
    for i, stage in enumerate(value):
        where = f"{KEY}[{i}]"
        if not isinstance(stage, ScheduleStep) or not (_whole(stage.start) and _whole(stage.value)):
            raise ConfigError(
                f"{where} must be {{start: STEP, value: SIZE}} with whole numbers ({_EXAMPLE}), got {stage!r}."
            )
        if stage.value < 1:
            raise ConfigError(f"{where}.value must be at least 1 example per step, got {stage.value}.")
        if i == 0 and stage.start != 0:
            raise ConfigError(
                f"{where}.start is {stage.start}: the first stage of a batch-size schedule starts at step 0. Add a "
                f"stage {{start: 0, value: SIZE}} first, or set this one's start to 0."
            )
        if i and stage.start <= value[i - 1].start:
            raise ConfigError(
                f"{where}.start is {stage.start}, not after {KEY}[{i - 1}].start ({value[i - 1].start}): the stages' "
                "starts must rise strictly. Order the stages by start, and merge stages that start at the same step."
            )


def batch_schedule(value: int | Sequence[ScheduleStep]) -> shard_cache.BatchSchedule:
    """The schedule of a checked `trainer.train_batch_size` (one stage for a size)."""
    if isinstance(value, Sequence):
        return shard_cache.BatchSchedule([(stage.start, stage.value) for stage in value])
    return shard_cache.BatchSchedule(value)


def padding_multiple(data_size: int, process_count: int) -> int:
    """What a global batch is padded to a multiple of: every data-parallel device and process gets equal rows."""
    return math.lcm(data_size, process_count)


def padded(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple` (Levanter's padding of a batch that does not divide)."""
    return -(-size // multiple) * multiple


def size_where(schedule: shard_cache.BatchSchedule, size: int) -> str:
    """How an error names a size: the key alone for a fixed size, else the stage that first uses it."""
    if schedule.fixed is not None:
        return f"{KEY}={size}"
    k = schedule.sizes.index(size)
    return f"{KEY}[{k}].value={size} (from step {schedule.starts[k]})"


def planned_batch(config: Any, data_size: int, process_count: int = 1) -> Any:
    """A run's config (TrainLmConfig) with its largest batch size, padded where allowed, as its one size: the step
    that plans and memory checks size, since the largest batch needs the most memory."""
    trainer = config.trainer
    schedule = trainer.batch_schedule
    size = schedule.largest
    if trainer.allow_nondivisible_batch_size:
        size = padded(size, padding_multiple(data_size, process_count))
    if schedule.fixed == size:
        return config
    trainer = dataclasses.replace(trainer, train_batch_size=size, allow_nondivisible_batch_size=False)
    return dataclasses.replace(config, trainer=trainer)


def bad_value_text(raw: Any) -> str:
    """Why a raw `trainer.train_batch_size` (as YAML gave it) could not be read, and what to write instead."""
    if isinstance(raw, list):
        for i, stage in enumerate(raw):
            if not isinstance(stage, dict) or set(stage) != {"start", "value"}:
                return f"{KEY}[{i}] is {stage!r}: each stage is {{start: STEP, value: SIZE}} ({_EXAMPLE})."
            bad = [key for key in ("start", "value") if not _whole(stage[key])]
            if bad:
                return f"{KEY}[{i}].{bad[0]} is {stage[bad[0]]!r}: write a whole number ({_EXAMPLE})."
    return f"{KEY} is {raw!r}: write a number of examples per step, or a list of {{start, value}} stages ({_EXAMPLE})."
