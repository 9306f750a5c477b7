"""One builder for every optimizer config: gradient clipping, then the config's own update rule on its schedule, with
weight decay on the parameters the decay mask picks."""

from __future__ import annotations

import re
from typing import Any

import jax
import optax

import named_tensors as nt
from lm_train.config.optimizer_config import OptimizerConfig, ScheduleConfig
from lm_train.errors import ConfigError
from lm_train.optim.interface import Optimizer, chain
from lm_train.optim.schedule import learning_rate_schedule

# Axes that mark embedding tables: no weight decay by default (as in GPT-2 and most LLM recipes).
_EMBEDDING_AXES = frozenset({"vocab", "position"})


def default_decay(param: Any) -> bool:
    """Decay matrices; not norms, biases (1-d parameters) or embedding tables."""
    if isinstance(param, nt.NamedArray):
        names = set(param.axis_names) - {"layers"}
        return len(names) >= 2 and not (names & _EMBEDDING_AXES)
    return getattr(param, "ndim", 0) >= 2


def weight_decay_mask(params: Any, patterns: tuple[str, ...] | None = None) -> Any:
    """A tree of bools, one per parameter (NamedArrays counted whole): which parameters get weight decay."""
    compiled = [re.compile(p) for p in patterns] if patterns is not None else None

    def decide(path: tuple, leaf: Any) -> bool:
        if leaf is None:
            return False
        if compiled is not None:
            text = nt.path_str(path)
            return any(p.search(text) for p in compiled)
        return default_decay(leaf)

    return jax.tree_util.tree_map_with_path(decide, params, is_leaf=nt.is_named)


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
