"""One builder for every optimizer config: gradient clipping, then the config's own update rule on its schedule."""

from __future__ import annotations

import optax

from lm_train.config.optimizer_config import OptimizerConfig, ScheduleConfig
from lm_train.errors import ConfigError
from lm_train.optim.decay_mask import weight_decay_mask
from lm_train.optim.interface import Optimizer, chain
from lm_train.optim.schedule import learning_rate_schedule


def build_optimizer(config: ScheduleConfig, num_train_steps: int) -> tuple[Optimizer, optax.Schedule]:
    """The optimizer for a config (clipping first, if set), and its learning-rate schedule (for logging)."""
    if not isinstance(config, OptimizerConfig):
        raise ConfigError(f"optimizer.type {type(config).__name__} is not a registered optimizer config.")
    schedule = learning_rate_schedule(config, num_train_steps)

    def decay_mask(params):
        return weight_decay_mask(params, config.weight_decay_modules)

    clip = config.max_grad_norm is not None and not config.clips_own_gradients
    parts = [optax.clip_by_global_norm(config.max_grad_norm)] if clip else []
    parts.append(config.update_rule(schedule, decay_mask))
    return chain(*parts), schedule
