"""The learning-rate schedule of every optimizer: cycles of warm-up, a stable phase, then decay (Levanter's WSD)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import optax

from lm_train.config.optimizer_config import ScheduleConfig
from lm_train.errors import ConfigError


def _steps(value: float, length: int) -> int:
    """A fraction of `length` if < 1, else a number of steps."""
    return int(value * length) if value < 1 else int(value)


def cycle_ends(config: ScheduleConfig, num_train_steps: int) -> list[int]:
    """The steps where the cycles start and end: [0, end of cycle 1, ..., num_train_steps]."""
    total = num_train_steps
    if isinstance(config.cycle_length, tuple):
        ends, at = [], 0
        for length in config.cycle_length:
            at += int(length)
            ends.append(at)
    elif config.cycle_length is not None:
        length = max(1, _steps(config.cycle_length, total))
        ends = [i * length for i in range(1, total // length)]
    elif isinstance(config.cycles, tuple):
        ends = [int(end) for end in config.cycles]
    elif config.cycles is not None:
        ends = [int(total / config.cycles * (i + 1)) for i in range(config.cycles - 1)]
    else:
        ends = []
    points = [0, *ends]
    if points[-1] != total:
        points.append(total)
    if any(b <= a for a, b in itertools.pairwise(points)):
        key = "cycle_length" if config.cycle_length is not None else "cycles"
        raise ConfigError(
            f"optimizer.{key} gives cycles ending at steps {points[1:]}, which do not increase up to "
            f"trainer.num_train_steps ({total}): give increasing ends below it (or fewer cycles)."
        )
    return points


def _decay_shape(config: ScheduleConfig, peak: float, warmup: int, decay: int) -> optax.Schedule:
    floor = peak * config.min_lr_ratio
    if config.lr_schedule == "constant" or decay == 0:
        return optax.constant_schedule(peak)
    if config.lr_schedule == "linear":
        return optax.linear_schedule(peak, floor, decay)
    if config.lr_schedule == "inv_sqrt":  # Levanter's: timescale 10000 steps, counted from the end of warm-up

        def inv_sqrt(count):
            factor = jnp.minimum(1.0, 1.0 / jnp.sqrt(jnp.maximum(count + warmup, 1) / 10000.0))
            return jnp.maximum(peak * factor, floor)

        return inv_sqrt
    if config.lr_schedule == "inv":  # 1 / (1 + a t), reaching the floor at the end of the decay

        def inv(count):
            factor = jnp.minimum(1.0, 1.0 / ((peak / floor - 1.0) * jnp.maximum(count, 1) / decay + 1.0))
            return jnp.maximum(peak * factor, floor)

        return inv
    return optax.cosine_decay_schedule(peak, decay, alpha=config.min_lr_ratio)


def learning_rate_schedule(config: ScheduleConfig, num_train_steps: int) -> optax.Schedule:
    """Per cycle: linear warm-up to learning_rate, hold it, then decay over the cycle's last `decay` steps.

    The first cycle warms up from 0 over `warmup`; later ones from where the last ended over `rewarmup`. With
    decay null the decay takes the whole cycle after warm-up (no stable phase).
    """
    peak = config.learning_rate
    points = cycle_ends(config, num_train_steps)
    schedules: list[optax.Schedule] = []
    boundaries: list[int] = []
    previous_end = 0.0
    for cycle, (start, end) in enumerate(itertools.pairwise(points)):
        length = end - start
        warmup = _steps(config.warmup if cycle == 0 else config.rewarmup, length)
        decay = _steps(config.decay, length) if config.decay is not None else length - warmup
        stable = length - warmup - decay
        if stable < 0 or warmup > length:
            raise ConfigError(
                f"optimizer.warmup/rewarmup ({warmup} steps) and optimizer.decay ({decay} steps) are longer than "
                f"the schedule's cycle of {length} steps (trainer.num_train_steps {num_train_steps}): shorten them "
                "or give them as fractions (< 1)."
            )
        if warmup:
            schedules.append(optax.linear_schedule(previous_end, peak, warmup))
            boundaries.append(start + warmup)
        if stable:
            schedules.append(optax.constant_schedule(peak))
            boundaries.append(start + warmup + stable)
        shape = _decay_shape(config, peak, warmup, decay)
        previous_end = float(shape(decay))
        schedules.append(shape)
        boundaries.append(end)
    if len(schedules) == 1:
        return schedules[0]
    return optax.join_schedules(schedules, boundaries[:-1])
