"""Model averaging: the EMA of the trainable weights that the trainer state keeps, its update and its model."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from lm_train.post.lora_training import split_trainable


def _map(fn: Any, *trees: Any) -> Any:
    # None marks a leaf left out of the trainable tree (frozen base weights under LoRA): it stays None.
    return jax.tree_util.tree_map(lambda *xs: None if xs[0] is None else fn(*xs), *trees, is_leaf=lambda x: x is None)


def initial_average(model: Any) -> Any:
    """The average at the start: a copy of the model's trainable weights (its own buffers, so both can be donated)."""
    params, _ = split_trainable(model)
    return _map(lambda p: jnp.array(p, copy=True), params)


def ema_update(average: Any, params: Any, beta: float) -> Any:
    """beta * average + (1 - beta) * params, leaf by leaf, in the average's dtype."""
    return _map(lambda a, p: (beta * a + (1.0 - beta) * p.astype(a.dtype)).astype(a.dtype), average, params)


def averaged_model(model: Any, average: Any) -> Any:
    """The model with its trainable weights replaced by their average."""
    _, static = split_trainable(model)
    return eqx.combine(average, static)


def exported_model(state: Any, averaging: Any) -> Any:
    """The model a run exports: its weight average when it keeps one and `export_ema` says so, else its own."""
    if state.averaged is None or averaging is None or not averaging.export_ema:
        return state.model
    return averaged_model(state.model, state.averaged)
