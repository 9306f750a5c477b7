"""Optimizers from config: AdamW with warm-up and decay, a weight-decay mask, and gradient clipping."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import optax

import named_tensors as nt
from lm_train.config.schema import AdamConfig, OptimizerConfig, _ScheduleMixin
from lm_train.errors import ConfigError

# Axes that mark embedding tables: no weight decay by default (as in GPT-2 and most LLM recipes).
_EMBEDDING_AXES = frozenset({"vocab", "position"})


def _steps(value: float | None, num_train_steps: int, default: int) -> int:
    if value is None:
        return default
    return round(value * num_train_steps) if value < 1 else int(value)


def learning_rate_schedule(config: _ScheduleMixin, num_train_steps: int) -> optax.Schedule:
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


def _path_string(path: tuple) -> str:
    parts = []
    for k in path:
        name = getattr(k, "name", None) or getattr(k, "key", None)
        if name is None:
            name = getattr(k, "idx", k)
        parts.append(str(name))
    return ".".join(parts)


def default_decay(path: str, param: Any) -> bool:
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
        text = _path_string(path)
        if compiled is not None:
            return any(p.search(text) for p in compiled)
        return default_decay(text, leaf)

    return jax.tree_util.tree_map_with_path(decide, params, is_leaf=nt.is_named)


def build_optimizer(
    config: OptimizerConfig, num_train_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for a config, and its learning-rate schedule (for logging)."""
    if getattr(config, "estimator", None) is not None:
        from lm_train.sophia import build_sophia

        return build_sophia(config, num_train_steps)
    if not isinstance(config, AdamConfig):
        raise ConfigError(f"optimizer.type {type(config).__name__} is not supported by this trainer.")
    schedule = learning_rate_schedule(config, num_train_steps)
    mask: Callable[[Any], Any] = lambda params: weight_decay_mask(params, config.weight_decay_modules)  # noqa: E731
    parts = []
    if config.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(
        optax.adamw(
            schedule,
            b1=config.beta1,
            b2=config.beta2,
            eps=config.epsilon,
            weight_decay=config.weight_decay,
            mask=mask,
        )
    )
    return optax.chain(*parts), schedule
