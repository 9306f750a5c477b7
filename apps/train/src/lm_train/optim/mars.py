"""MARS-AdamW (Yuan et al., 2024, arXiv 2411.10438): AdamW on a variance-reduced gradient.

The update (Algorithm 1 of the paper, its AdamW instance, with the exact gradient difference):

    c_t = g_t + gamma * b1 / (1 - b1) * (g_t - g_{t-1})          g_0 = 0
    c_t = c_t * min(1, max_grad_norm / ||c_t||)                  (global norm over all parameters; paper: 1)
    m_t = b1 * m_{t-1} + (1 - b1) * c_t
    v_t = b2 * v_{t-1} + (1 - b2) * c_t^2
    theta_{t+1} = theta_t - lr_t * (m_t / (1 - b1^t) / (sqrt(v_t / (1 - b2^t)) + eps) + weight_decay * mask * theta_t)

The clip acts on c_t, not on the raw gradient, so the builder adds no clipping of its own in front (the config
sets `clips_own_gradients`). The state keeps the last raw gradient g_{t-1}, so resume is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class MarsState(NamedTuple):
    """State of `scale_by_mars`: step count, Adam's two moments of c, and the previous raw gradient."""

    count: jax.Array
    mu: PyTree
    nu: PyTree
    previous_grad: PyTree


def scale_by_mars(
    *, b1: float = 0.95, b2: float = 0.99, gamma: float = 0.025, eps: float = 1e-8, max_grad_norm: float | None = 1.0
) -> optax.GradientTransformation:
    """MARS-AdamW's direction m_hat / (sqrt(v_hat) + eps) of the corrected, clipped gradient; no learning rate."""
    correction = gamma * b1 / (1.0 - b1)

    def init(params: PyTree) -> MarsState:
        zeros = lambda: jax.tree_util.tree_map(jnp.zeros_like, params)  # noqa: E731
        return MarsState(jnp.zeros((), jnp.int32), zeros(), zeros(), zeros())

    def update(updates: PyTree, state: MarsState, params: PyTree = None) -> tuple[PyTree, MarsState]:
        del params
        c = jax.tree_util.tree_map(lambda g, p: g + correction * (g - p), updates, state.previous_grad)
        if max_grad_norm:
            scale = jnp.minimum(1.0, max_grad_norm / jnp.maximum(optax.tree.norm(c), 1e-30))
            c = jax.tree_util.tree_map(lambda x: x * scale.astype(x.dtype), c)
        count = state.count + 1
        mu = jax.tree_util.tree_map(lambda m, x: b1 * m + (1.0 - b1) * x, state.mu, c)
        nu = jax.tree_util.tree_map(lambda v, x: b2 * v + (1.0 - b2) * x * x, state.nu, c)
        t = count.astype(jnp.float32)
        mu_correction, nu_correction = 1.0 - b1**t, 1.0 - b2**t
        direction = jax.tree_util.tree_map(
            lambda m, v: (m / mu_correction) / (jnp.sqrt(v / nu_correction) + eps), mu, nu
        )
        return direction, MarsState(count, mu, nu, updates)

    return optax.GradientTransformation(init, update)


def mars(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.95,
    b2: float = 0.99,
    gamma: float = 0.025,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
    weight_decay: float = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
) -> optax.GradientTransformation:
    """MARS-AdamW with decoupled weight decay on the parameters `mask` selects, on a learning-rate schedule."""
    parts = [scale_by_mars(b1=b1, b2=b2, gamma=gamma, eps=eps, max_grad_norm=max_grad_norm)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
