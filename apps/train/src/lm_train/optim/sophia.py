"""Sophia (Liu et al., 2023, arXiv 2305.14342) as optax transformations, with both Hessian estimators.

The update, per coordinate (Algorithm 3 of the paper):

    m_t = b1 * m_{t-1} + (1 - b1) * g_t
    h_t = b2 * h_{t-k} + (1 - b2) * h_hat_t     only at steps t = 0, k, 2k, ... (else h_t = h_{t-1})
    theta_{t+1} = theta_t - lr_t * (clip(m_t / max(gamma * h_t, eps), -1, 1) + weight_decay * mask * theta_t)

No bias correction, as in the paper and the official implementation: m and h both start at zero and the clip
bounds every step by lr, so early steps are sign-like steps of size at most lr. h_hat comes from outside the
normal optax update (it needs the loss function, not just the gradient), so the state keeps h, and `sophia`
returns an Optimizer whose `hessian_update` hook refreshes it from the step's objective before `update` runs
(the train step calls the hook; by hand, `maybe_update_hessian(opt_state, estimate)` does the same):

    opt_state = optimizer.hessian_update(opt_state, params, objective)
    updates, opt_state = optimizer.update(grads, opt_state, params)

Estimators (lm_train.optim.hessian): Hutchinson's for Sophia-H, Gauss-Newton-Bartlett's for Sophia-G.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import named_tensors as nt
from lm_train.optim.hessian import gauss_newton_bartlett_diagonal, hutchinson_diagonal
from lm_train.optim.interface import HessianObjective, Optimizer

PyTree = Any


# -- the transformation -------------------------------------------------------------------------------------


class SophiaState(eqx.Module):
    """State of `scale_by_sophia`: step count, EMA of gradients, EMA of the Hessian diagonal, a statistic."""

    count: jax.Array
    """Number of updates done (int32); the Hessian is refreshed when count % hessian_every == 0."""
    mu: PyTree
    """EMA of the gradients (beta1)."""
    hessian: PyTree
    """EMA of the Hessian-diagonal estimates (beta2)."""
    unclipped_fraction: jax.Array
    """Share of coordinates whose last preconditioned step |m / max(gamma h, eps)| was below 1 (not clipped)."""
    hessian_decay: float = eqx.field(static=True, default=0.99)
    hessian_every: int = eqx.field(static=True, default=10)


def scale_by_sophia(
    *,
    gamma: float,
    b1: float = 0.96,
    b2: float = 0.99,
    eps: float = 1e-12,
    update_hessian_every: int = 10,
) -> optax.GradientTransformation:
    """Sophia's preconditioned, clipped direction clip(m / max(gamma * h, eps), -1, 1); no learning rate."""
    if update_hessian_every < 1:
        raise ValueError(f"update_hessian_every must be at least 1, got {update_hessian_every}")

    def init(params: PyTree) -> SophiaState:
        return SophiaState(
            count=jnp.zeros((), jnp.int32),
            mu=jax.tree_util.tree_map(jnp.zeros_like, params),
            hessian=jax.tree_util.tree_map(jnp.zeros_like, params),
            unclipped_fraction=jnp.ones((), jnp.float32),
            hessian_decay=b2,
            hessian_every=update_hessian_every,
        )

    def update(updates: PyTree, state: SophiaState, params: PyTree = None) -> tuple[PyTree, SophiaState]:
        del params
        mu = jax.tree_util.tree_map(lambda g, m: b1 * m + (1.0 - b1) * g.astype(m.dtype), updates, state.mu)
        ratio = jax.tree_util.tree_map(lambda m, h: m / jnp.maximum(gamma * h, eps), mu, state.hessian)
        leaves = jax.tree_util.tree_leaves(ratio)
        total = sum(x.size for x in leaves)
        unclipped = sum((jnp.sum(jnp.abs(x) < 1.0).astype(jnp.float32) for x in leaves), jnp.zeros((), jnp.float32))
        fraction = unclipped / max(total, 1)
        direction = jax.tree_util.tree_map(lambda r, g: jnp.clip(r, -1.0, 1.0).astype(g.dtype), ratio, updates)
        new_state = SophiaState(
            count=state.count + 1,
            mu=mu,
            hessian=state.hessian,
            unclipped_fraction=fraction,
            hessian_decay=state.hessian_decay,
            hessian_every=state.hessian_every,
        )
        return direction, new_state

    return optax.GradientTransformation(init, update)


Estimator = Literal["hutchinson", "gauss_newton_bartlett"]


def sophia(
    learning_rate: float | optax.Schedule,
    *,
    gamma: float,
    b1: float = 0.96,
    b2: float = 0.99,
    eps: float = 1e-12,
    weight_decay: float = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    update_hessian_every: int = 10,
    estimator: Estimator = "hutchinson",
) -> Optimizer:
    """Sophia with decoupled weight decay (on the parameters `mask` selects, as in optax.adamw) and a schedule.

    Its `hessian_update` hook refreshes the Hessian EMA every `update_hessian_every` steps with `estimator`'s
    estimate on the step's objective; its `metrics` hook reports `optim/sophia_unclipped_fraction`.
    """
    if estimator not in ("hutchinson", "gauss_newton_bartlett"):
        raise ValueError(f"estimator must be 'hutchinson' or 'gauss_newton_bartlett', got {estimator!r}")
    parts = [scale_by_sophia(gamma=gamma, b1=b1, b2=b2, eps=eps, update_hessian_every=update_hessian_every)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    chained = optax.chain(*parts)

    def estimate(params: PyTree, objective: HessianObjective) -> PyTree:
        if estimator == "hutchinson":
            return hutchinson_diagonal(objective.loss, params, objective.key)
        return gauss_newton_bartlett_diagonal(objective.logits, params, objective.key, mask=objective.target_mask)

    def hessian_update(opt_state: PyTree, params: PyTree, objective: HessianObjective) -> PyTree:
        return maybe_update_hessian(opt_state, lambda: nt.shard(estimate(params, objective)))

    def metrics(opt_state: PyTree) -> dict[str, jax.Array]:
        return {"optim/sophia_unclipped_fraction": unclipped_fraction(opt_state)}

    return Optimizer(chained.init, chained.update, hessian_update, metrics)


# -- reaching the state inside a chain ----------------------------------------------------------------------


def _is_state(x: Any) -> bool:
    return isinstance(x, SophiaState)


def sophia_state(opt_state: PyTree) -> SophiaState:
    """The one SophiaState inside an optimizer state (e.g. a chain's tuple); an error if there is not one."""
    found = [s for s in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
    if len(found) != 1:
        raise ValueError(f"expected exactly one Sophia state in the optimizer state, found {len(found)}")
    return found[0]


def _replace_state(opt_state: PyTree, fn: Callable[[SophiaState], SophiaState]) -> PyTree:
    return jax.tree_util.tree_map(lambda s: fn(s) if _is_state(s) else s, opt_state, is_leaf=_is_state)


def hessian_update_due(opt_state: PyTree) -> jax.Array:
    """Whether this step refreshes the Hessian: count % update_hessian_every == 0 (steps 0, k, 2k, ...)."""
    state = sophia_state(opt_state)
    return state.count % state.hessian_every == 0


def update_hessian(opt_state: PyTree, h_hat: PyTree) -> PyTree:
    """Fold one Hessian-diagonal estimate into the EMA: h = b2 * h + (1 - b2) * h_hat (unconditionally)."""

    def fold(state: SophiaState) -> SophiaState:
        b2 = state.hessian_decay
        hessian = jax.tree_util.tree_map(lambda h, e: b2 * h + (1.0 - b2) * e.astype(h.dtype), state.hessian, h_hat)
        return eqx.tree_at(lambda s: s.hessian, state, hessian)

    return _replace_state(opt_state, fold)


def maybe_update_hessian(opt_state: PyTree, estimate: Callable[[], PyTree]) -> PyTree:
    """Refresh the Hessian EMA with `estimate()` when it is due (see hessian_update_due); works under jit.

    `estimate` runs only on the steps that need it (a lax.cond), so its cost is paid every k steps.
    """
    return jax.lax.cond(hessian_update_due(opt_state), lambda s: update_hessian(s, estimate()), lambda s: s, opt_state)


def unclipped_fraction(opt_state: PyTree) -> jax.Array:
    """The share of coordinates not clipped at the last update: log it as `optim/sophia_unclipped_fraction`."""
    return sophia_state(opt_state).unclipped_fraction
