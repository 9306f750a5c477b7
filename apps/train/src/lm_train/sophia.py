"""Sophia (Liu et al., 2023, arXiv 2305.14342) as optax transformations, with both Hessian estimators.

The update, per coordinate (Algorithm 3 of the paper):

    m_t = b1 * m_{t-1} + (1 - b1) * g_t
    h_t = b2 * h_{t-k} + (1 - b2) * h_hat_t     only at steps t = 0, k, 2k, ... (else h_t = h_{t-1})
    theta_{t+1} = theta_t - lr_t * (clip(m_t / max(gamma * h_t, eps), -1, 1) + weight_decay * mask * theta_t)

No bias correction, as in the paper and the official implementation: m and h both start at zero and the clip
bounds every step by lr, so early steps are sign-like steps of size at most lr. h_hat comes from outside the
normal optax update (it needs the loss function, not just the gradient), so the state keeps h and the train
step refreshes it with `maybe_update_hessian(opt_state, estimate)` before calling `optimizer.update`:

    opt_state = maybe_update_hessian(opt_state, lambda: hutchinson_diagonal(loss_fn, params, key))
    updates, opt_state = optimizer.update(grads, opt_state, params)

Estimators: `hutchinson_diagonal` (Sophia-H: u * Hu with a Hessian-vector product) and
`gauss_newton_bartlett_diagonal` (Sophia-G: B * g_hat**2, g_hat the gradient of the mean loss on labels sampled
from the model's own softmax). Both work on any pytree of float arrays, equinox Modules and NamedArrays included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import named_tensors as nt
from lm_train.config.schema import (  # the configs live with the others; re-exported here
    GAMMA_SOPHIA_G,  # noqa: F401
    GAMMA_SOPHIA_H,
    SophiaConfig,  # noqa: F401
    SophiaGConfig,
    SophiaHConfig,
)
from lm_train.optim import learning_rate_schedule, weight_decay_mask

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
    b1: float = 0.96,
    b2: float = 0.99,
    gamma: float = GAMMA_SOPHIA_H,
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


def sophia(
    learning_rate: float | optax.Schedule,
    *,
    b1: float = 0.96,
    b2: float = 0.99,
    gamma: float = GAMMA_SOPHIA_H,
    eps: float = 1e-12,
    weight_decay: float = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    update_hessian_every: int = 10,
) -> optax.GradientTransformation:
    """Sophia with decoupled weight decay (on the parameters `mask` selects, as in optax.adamw) and a schedule."""
    parts = [scale_by_sophia(b1, b2, gamma, eps, update_hessian_every)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


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


# -- estimators of the Hessian diagonal ---------------------------------------------------------------------


def _random_like(params: PyTree, key: jax.Array, distribution: Literal["normal", "rademacher"]) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, max(len(leaves), 1))
    if distribution == "normal":
        draw = jax.random.normal
    elif distribution == "rademacher":
        draw = jax.random.rademacher
    else:
        raise ValueError(f"distribution must be 'normal' or 'rademacher', got {distribution!r}")
    return jax.tree_util.tree_unflatten(treedef, [draw(keys[i], x.shape, x.dtype) for i, x in enumerate(leaves)])


def hutchinson_diagonal(
    loss_fn: Callable[[PyTree], jax.Array],
    params: PyTree,
    key: jax.Array,
    *,
    distribution: Literal["normal", "rademacher"] = "normal",
) -> PyTree:
    """Sophia-H's estimate of diag(H) of loss_fn at params: u * (H u), u ~ N(0, I) or Rademacher.

    params: a pytree of float arrays (e.g. `eqx.filter(model, eqx.is_inexact_array)`); loss_fn(params) is a
    scalar. H u is a Hessian-vector product taken reverse-over-reverse, grad(<grad loss, u>): forward mode
    would be cheaper, but it cannot pass through jax.custom_vjp functions, which fused attention and losses
    use. The estimate is unbiased; it may be negative where the loss is not convex.
    """
    u = _random_like(params, key, distribution)

    def directional_derivative(p: PyTree) -> jax.Array:
        grads = jax.grad(loss_fn)(p)
        products = jax.tree_util.tree_map(lambda g, v: jnp.sum(g * v).astype(jnp.float32), grads, u)
        return sum(jax.tree_util.tree_leaves(products), jnp.zeros((), jnp.float32))

    hu = jax.grad(directional_derivative)(params)
    return jax.tree_util.tree_map(lambda a, b: a * b, u, hu)


def sampled_label_loss(
    logits: jax.Array | nt.NamedArray,
    key: jax.Array,
    *,
    mask: jax.Array | nt.NamedArray | None = None,
    vocab_axis: str = "vocab",
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of logits against labels sampled from softmax(logits), and the number of tokens.

    Plain-array logits have the vocabulary last; NamedArray logits name it (`vocab_axis`). mask (bool or
    0/1 weights over the logits' other axes) drops tokens. The samples carry no gradient.
    """
    if isinstance(logits, nt.NamedArray):
        Vocab = logits.resolve_axis(vocab_axis)
        logits = nt.permute(logits, (..., Vocab.name))
        other = logits.axes[:-1]
        raw = logits.array
        if isinstance(mask, nt.NamedArray):
            mask = nt.broadcast_to(mask, other).array
    else:
        raw = logits
    raw = raw.astype(jnp.float32)
    labels = jax.random.categorical(key, jax.lax.stop_gradient(raw), axis=-1)
    logp = jax.nn.log_softmax(raw, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll), jnp.asarray(nll.size, jnp.float32)
    weights = jnp.broadcast_to(jnp.asarray(mask).astype(jnp.float32), nll.shape)
    count = jnp.sum(weights)
    return jnp.sum(nll * weights) / jnp.maximum(count, 1.0), count


def gauss_newton_bartlett_diagonal(
    logits_fn: Callable[[PyTree], jax.Array | nt.NamedArray],
    params: PyTree,
    key: jax.Array,
    *,
    mask: jax.Array | nt.NamedArray | None = None,
    vocab_axis: str = "vocab",
) -> PyTree:
    """Sophia-G's estimate of diag(H): B * g_hat * g_hat (Algorithm 2 of the paper).

    logits_fn(params) gives the model's logits on a batch; labels y_hat are sampled from softmax(logits) with
    `key`; g_hat is the gradient of the mean cross-entropy against y_hat (over the tokens `mask` keeps) and B
    the number of those tokens. The estimate is never negative.
    """

    def loss(p: PyTree) -> tuple[jax.Array, jax.Array]:
        return sampled_label_loss(logits_fn(p), key, mask=mask, vocab_axis=vocab_axis)

    g_hat, count = jax.grad(loss, has_aux=True)(params)
    return jax.tree_util.tree_map(lambda g: count.astype(g.dtype) * g * g, g_hat)


def build_sophia(
    config: SophiaHConfig | SophiaGConfig, num_train_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation for a Sophia config (gradient clipping first), and its learning-rate schedule."""
    schedule = learning_rate_schedule(config, num_train_steps)
    mask: Callable[[Any], Any] = lambda params: weight_decay_mask(params, config.weight_decay_modules)  # noqa: E731
    parts = []
    if config.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(
        sophia(
            schedule,
            b1=config.beta1,
            b2=config.beta2,
            gamma=config.gamma,
            eps=config.epsilon,
            weight_decay=config.weight_decay,
            mask=mask,
            update_hessian_every=config.update_hessian_every,
        )
    )
    return optax.chain(*parts), schedule
