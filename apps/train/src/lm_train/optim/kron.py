"""PSGD Kron (Li, arXiv 1512.04202 and 2402.11858; Evan Walters' psgd_jax, as Levanter runs it): momentum whitened by
a Kronecker product of per-dimension factors Q_i, fitted online.

For each block G of the bias-corrected momentum (mu_t = b1 mu_{t-1} + (1 - b1) g_t, G = mu_t / (1 - b1^t)), with a
factor on each of its dimensions i: an upper-triangular d_i x d_i matrix Q_i, or a diagonal q_i (a vector) where d_i is
1, exceeds max_size_triangular, the parameter has fewer than min_ndim_triangular dimensions, or memory_save_mode says
so. Below, x_i is the product along dimension i ((G x_i M)[.., a, ..] = sum_b M[a, b] G[.., b, ..]):

    direction         P G = G x_i (Q_i^T Q_i)             (q_i^2 for a diagonal)
    factor update     V ~ N(0, 1) of G's shape;  G~ = G + sqrt(eps_float32) * mean|G| * V
    (when due)        A = G~ x_i Q_i;   C = V x_i Q_i^{-T}            (each with the factors before this update)
                      T1 = A_(i) A_(i)^T,  T2 = C_(i) C_(i)^T     (over the other dimensions; a diagonal: its diagonal)
                      Q_i <- Q_i - lr_p / |T1 + T2| * triu(T1 - T2) Q_i      |.|: a lower bound of the spectral norm
                      q_i <- q_i - lr_p / max|T1 + T2| * (T1 - T2) * q_i
    balance           every `balance_every`-th update (Levanter: 100), first, each block's factors are rescaled so that
                      their max |entries| all equal their geometric mean (their product, the preconditioner, unchanged)

The factors start at init_scale^(1/k) * I for a block of k dimensions. The fit drives E[P G G^T P] to E[V V^T]: P
whitens the momentum. The factor update runs in float32; its matmuls take precond_update_precision, the direction's take
precond_grads_precision. `kron` then clips the direction to RMS 1.1 per parameter, adds weight decay and scales by -lr,
as Levanter's chain does.

When the factors update, and the random V: both follow from the step alone, so a resumed run makes the same draws. The
update is due when a counter of the steps since the last one reaches 1 / p(t), p(t) = clip(exp(-0.001 (t -
update_prob_flat_start)), preconditioner_update_probability, 1) (Levanter's deterministic reading of psgd's coin flip;
the counter is in the state). V of parameter j at step t is jax.random.normal(split(fold_in(PRNGKey(PROBE_SEED), t),
n)[j], (B, *block)): derived from the step count, with no key carried in the state. Threefry's draws do not depend on
the sharding, so V is the same on any mesh.

Blocks (Levanter's keys; the view is lm_train.optim.blocks'): the stacked `layers` axis is a batch of separate blocks;
with merge_small_dims, neighbouring dimensions merge while their product stays <= target_merged_dim_size; with
partition_grads_into_blocks, a triangular dimension that block_size divides and exceeds is cut into blocks of
block_size, each with its own factors (one that it does not divide stays whole; Levanter pads it instead). The
momentum keeps the parameter's layout and sharding; the factors are replicated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import named_tensors as nt
from lm_train.optim.blocks import leaves, raw
from lm_train.optim.kron_factors import KronLayout, balance_factors, kron_layout, precondition, refresh_factors

PyTree = Any
PROBE_SEED = 0
"""The base key of the random probe vectors V; the step count is folded into it."""


def update_probability_schedule(
    min_prob: float, flat_start: float, max_prob: float = 1.0, decay: float = 0.001
) -> Callable[[jax.Array], jax.Array]:
    """Levanter's p(t): max_prob for flat_start steps, then exp(-decay * (t - flat_start)), never below min_prob."""

    def schedule(step: jax.Array) -> jax.Array:
        t = jnp.asarray(step).astype(jnp.float32)
        return jnp.clip(max_prob * jnp.exp(-decay * (t - flat_start)), min_prob, max_prob)

    return schedule


def _precision(name: str | None) -> contextlib.AbstractContextManager:
    return jax.default_matmul_precision(name) if name else contextlib.nullcontext()


class KronState(NamedTuple):
    """State of `scale_by_kron`: step count, momentum (None when b1 is 0), factors, and the two update counters."""

    count: jax.Array
    mu: PyTree
    qs: PyTree
    """Per parameter, a tuple over its block's dimensions: (B, d, d) triangular or (B, d) diagonal factors."""
    update_counter: jax.Array
    """Steps since the factors last updated."""
    balance_counter: jax.Array
    """Factor updates since the factors were last balanced."""


def scale_by_kron(
    *,
    b1: float = 0.9,
    normalize_grads: bool = False,
    update_probability: float | Callable[[jax.Array], jax.Array] = update_probability_schedule(0.05, 500),
    max_size_triangular: int = 8192,
    min_ndim_triangular: int = 2,
    memory_save_mode: str | None = None,
    preconditioner_lr: float = 0.1,
    preconditioner_init_scale: float = 1.0,
    mu_dtype: Any = None,
    precond_dtype: Any = None,
    precond_update_precision: str | None = "tensorfloat32",
    precond_grads_precision: str | None = None,
    lax_map_scanned_layers: bool = False,
    lax_map_batch_size: int = 8,
    merge_small_dims: bool = False,
    target_merged_dim_size: int = 2048,
    partition_grads_into_blocks: bool = False,
    block_size: int = 256,
    balance_every: int = 100,
) -> optax.GradientTransformation:
    """Kron's direction P G (no learning rate); `update_probability` is p(t), a float or a function of the step t."""
    precond_dtype = jnp.dtype(precond_dtype or jnp.float32)

    def layout(leaf: Any) -> KronLayout:
        return kron_layout(
            leaf,
            max_size_triangular=max_size_triangular,
            min_ndim_triangular=min_ndim_triangular,
            memory_save_mode=memory_save_mode,
            merge_small_dims=merge_small_dims,
            target_merged_dim_size=target_merged_dim_size,
            partition_grads_into_blocks=partition_grads_into_blocks,
            block_size=block_size,
        )

    def over_blocks(fn: Callable, *args: Any) -> Any:
        """fn on each of the B blocks: vmap, or lax.map in batches (less memory) with lax_map_scanned_layers."""
        if lax_map_scanned_layers:
            return jax.lax.map(lambda xs: fn(*xs), args, batch_size=lax_map_batch_size)
        return jax.vmap(fn)(*args)

    def init(params: PyTree) -> KronState:
        qs = []
        for p in leaves(params)[0]:
            lay = layout(p)
            scale = preconditioner_init_scale ** (1.0 / len(lay.block))
            qs.append(
                tuple(
                    jnp.tile(scale * jnp.eye(d, dtype=precond_dtype), (lay.count, 1, 1))
                    if triangular
                    else jnp.full((lay.count, d), scale, precond_dtype)
                    for d, triangular in zip(lay.block, lay.triangular, strict=True)
                )
            )
        mu = jax.tree_util.tree_map(lambda x: jnp.zeros_like(x, dtype=mu_dtype), params) if b1 > 0 else None
        zero = jnp.zeros((), jnp.int32)
        return KronState(zero, mu, qs, zero, zero)

    def refresh(qs: list, balance_counter: jax.Array, blocks: list[jax.Array], count: jax.Array) -> tuple:
        balance_counter = balance_counter + 1
        balance_due = balance_counter >= balance_every
        balance_counter = jnp.where(balance_due, 0, balance_counter)
        qs = jax.lax.cond(
            balance_due,
            lambda qs: [over_blocks(balance_factors, q) if len(q) > 1 else q for q in qs],
            lambda qs: qs,
            qs,
        )
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(PROBE_SEED), count), len(blocks))
        new = []
        with _precision(precond_update_precision):
            for q, g, key in zip(qs, blocks, keys, strict=True):
                v = jax.random.normal(key, g.shape, jnp.float32)
                q32 = tuple(x.astype(jnp.float32) for x in q)
                fitted = over_blocks(partial(refresh_factors, lr=preconditioner_lr), q32, g.astype(jnp.float32), v)
                new.append(tuple(x.astype(precond_dtype) for x in fitted))
        return new, balance_counter

    def update(updates: PyTree, state: KronState, params: PyTree = None) -> tuple[PyTree, KronState]:
        del params
        count = optax.safe_increment(state.count)
        grads = updates
        if normalize_grads:
            grads = jax.tree_util.tree_map(lambda g: g / (jnp.linalg.norm(g) + 1e-16), grads)
        mu = None
        momentum = grads
        if b1 > 0:
            mu = jax.tree_util.tree_map(lambda m, g: (b1 * m + (1.0 - b1) * g).astype(m.dtype), state.mu, grads)
            correction = 1.0 - b1 ** count.astype(jnp.float32)
            momentum = jax.tree_util.tree_map(lambda m, g: (m / correction).astype(g.dtype), mu, grads)

        flat, treedef = leaves(momentum)
        layouts = [layout(x) for x in flat]
        blocks = [lay.to_blocks(raw(x)) for lay, x in zip(layouts, flat, strict=True)]

        p = update_probability(count) if callable(update_probability) else jnp.float32(update_probability)
        update_counter = state.update_counter + 1
        due = update_counter.astype(jnp.float32) >= 1.0 / p
        update_counter = jnp.where(due, 0, update_counter)
        qs, balance_counter = jax.lax.cond(
            due,
            lambda qs, bc: refresh(qs, bc, blocks, count),
            lambda qs, bc: (qs, bc),
            state.qs,
            state.balance_counter,
        )

        out = []
        with _precision(precond_grads_precision):
            for lay, x, q, g in zip(layouts, flat, qs, blocks, strict=True):
                work = jnp.promote_types(g.dtype, precond_dtype)
                direction = over_blocks(precondition, q, g.astype(work))
                array = lay.from_blocks(direction, raw(x).shape).astype(raw(x).dtype)
                out.append(nt.NamedArray(array, x.axes) if nt.is_named(x) else array)
        new_state = KronState(count, mu, qs, update_counter, balance_counter)
        return jax.tree_util.tree_unflatten(treedef, out), new_state

    return optax.GradientTransformation(init, update)


def kron(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    max_grad_norm: float | None = None,
    **settings: Any,
) -> optax.GradientTransformation:
    """Levanter's Kron chain: clip the gradient's global norm (unless normalize_grads), Kron's direction clipped to
    RMS 1.1 per parameter, decoupled weight decay on what `mask` selects, the learning rate; `settings` go to
    `scale_by_kron`."""
    parts = []
    if max_grad_norm and not settings.get("normalize_grads", False):
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts += [scale_by_kron(**settings), optax.clip_by_block_rms(1.1)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
