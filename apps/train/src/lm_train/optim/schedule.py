"""The learning-rate schedule of every optimizer: linear warm-up, then cosine, linear or constant."""

from __future__ import annotations

import optax

from lm_train.config.optimizer_config import ScheduleConfig


def _steps(value: float | None, num_train_steps: int, default: int) -> int:
    if value is None:
        return default
    return round(value * num_train_steps) if value < 1 else int(value)


def learning_rate_schedule(config: ScheduleConfig, num_train_steps: int) -> optax.Schedule:
    """Linear warm-up to learning_rate, then cosine/linear decay to learning_rate * min_lr_ratio."""
    peak = config.learning_rate
    floor = peak * config.min_lr_ratio
    warmup = min(_steps(config.warmup, num_train_steps, 0), num_train_steps)
    decay = _steps(config.decay, num_train_steps, num_train_steps - warmup)
    decay = max(1, min(decay, num_train_steps - warmup))
    if config.lr_schedule == "constant":
        after = optax.constant_schedule(peak)
    elif config.lr_schedule == "linear":
        after = optax.linear_schedule(peak, floor, decay)
    else:
        after = optax.cosine_decay_schedule(peak, decay, alpha=config.min_lr_ratio)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])
