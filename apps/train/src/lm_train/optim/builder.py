"""One builder for every optimizer config: gradient clipping, then the config's update rule on its schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from lm_train.config.optimizer_config import AdamConfig, ScheduleConfig, SophiaGConfig, SophiaHConfig
from lm_train.errors import ConfigError
from lm_train.optim.decay_mask import weight_decay_mask
from lm_train.optim.interface import Optimizer, chain
from lm_train.optim.schedule import learning_rate_schedule
from lm_train.optim.sophia import sophia


def _update_rule(config: ScheduleConfig, schedule: optax.Schedule, mask: Callable[[Any], Any]) -> Any:
    if isinstance(config, AdamConfig):
        return optax.adamw(
            schedule, b1=config.beta1, b2=config.beta2, eps=config.epsilon, weight_decay=config.weight_decay, mask=mask
        )
    if isinstance(config, SophiaHConfig | SophiaGConfig):
        return sophia(
            schedule,
            b1=config.beta1,
            b2=config.beta2,
            gamma=config.gamma,
            eps=config.epsilon,
            weight_decay=config.weight_decay,
            mask=mask,
            update_hessian_every=config.update_hessian_every,
            estimator=config.estimator,
        )
    raise ConfigError(f"optimizer.type {type(config).__name__} is not supported by this trainer.")


def build_optimizer(config: ScheduleConfig, num_train_steps: int) -> tuple[Optimizer, optax.Schedule]:
    """The optimizer for a config (clipping first, if set), and its learning-rate schedule (for logging)."""
    schedule = learning_rate_schedule(config, num_train_steps)
    mask: Callable[[Any], Any] = lambda params: weight_decay_mask(params, config.weight_decay_modules)  # noqa: E731
    parts = [optax.clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm is not None else []
    parts.append(_update_rule(config, schedule, mask))
    return chain(*parts), schedule
