"""Kron against a plain jax.numpy reference of PSGD's Kronecker-factored update, matrix by matrix; layouts; config."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_reference import flat, run_optimizer

import named_tensors as nt
from lm_train.config import KronConfig
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer
from lm_train.optim.kron import PROBE_SEED, kron, kron_layout

Layers, Heads, Embed, Mlp, Vocab = (
    nt.Axis("layers", 2),
    nt.Axis("heads", 3),
    nt.Axis("embed", 5),
    nt.Axis("mlp", 7),
    nt.Axis("vocab", 11),
)


def _params(seed: int) -> dict:
    rng = np.random.default_rng(seed)

    def named(*axes):
        return nt.NamedArray(jnp.asarray(rng.normal(size=[a.size for a in axes]).astype(np.float32)), axes)

    return {"w": named(Embed, Mlp), "x": named(Heads, Vocab), "norm": named(Embed)}


# With max_size_triangular 8: w (5 x 7) gets two triangular factors; x (3 x 11) a triangular one on its 3 rows and a
# diagonal one on its 11 columns; the norm (one dimension, below min_ndim_triangular) a diagonal one.
TRIANGULAR = {"w": (True, True), "x": (True, False), "norm": (False,)}
ORDER = ["norm", "w", "x"]  # the parameters' order in the flattened tree: the probe keys are split in this order


def norm_lower_bound(a):
    """|a y| for y = a c / |a c|, c the column of a with the largest norm (a symmetric): at most its spectral norm."""
    scale = jnp.max(jnp.abs(a))
    a = a / scale
    c = jnp.take(a, jnp.argmax(jnp.sum(a * a, axis=0)), axis=1)
    y = a @ c
    return scale * jnp.linalg.norm(a @ (y / jnp.linalg.norm(y)))


def fit(q, t1, t2, lr):
    """One step of a factor's fit: the triangular (Lie group) step, or the diagonal one."""
    if q.ndim == 1:
        return q - lr / (jnp.max(jnp.abs(t1 + t2)) + np.finfo(np.float32).tiny) * (t1 - t2) * q
    return q - lr / (norm_lower_bound(t1 + t2) + np.finfo(np.float32).tiny) * jnp.triu(t1 - t2) @ q


def inverse(q):
    """The inverse of an upper-triangular factor (the fit keeps them triangular)."""
    return jax.scipy.linalg.solve_triangular(q, jnp.eye(q.shape[0]), lower=False)


def as_matrix(q):
    """A factor as a matrix (a diagonal's vector on the diagonal)."""
    return jnp.diag(q) if q.ndim == 1 else q


def reference_step(state, grad, t, *, due, balance, lr, b1, lr_p, max_norm, wd, decayed):
    """Step t of PSGD Kron (Li 2024; psgd_jax/Levanter's chain) on matrices, written out directly; `due`: the factors
    update (`balance`: rescaled first)."""
    params, mu, factors = state
    g = {k: jnp.asarray(grad[f"{k}.0"]) for k in ORDER}
    total = jnp.sqrt(sum(jnp.sum(x * x) for x in g.values()))
    g = {k: x * jnp.minimum(1.0, max_norm / total) for k, x in g.items()}
    mu = {k: b1 * mu[k] + (1 - b1) * g[k] for k in ORDER}
    m = {k: mu[k] / (1 - b1**t) for k in ORDER}
    factors = dict(factors)
    if due:
        for k in ("w", "x"):
            norms = [jnp.max(jnp.abs(q)) for q in factors[k]]
            mean = jnp.exp(jnp.mean(jnp.log(jnp.stack(norms))))
            factors[k] = [jnp.where(balance, q * mean / n, q) for q, n in zip(factors[k], norms, strict=True)]
        keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(PROBE_SEED), t.astype(jnp.int32)), len(ORDER))
        for key, k in zip(keys, ORDER, strict=True):
            v = jax.random.normal(key, (1, *m[k].shape))[0]
            gd = m[k] + np.sqrt(np.finfo(np.float32).eps) * jnp.mean(jnp.abs(m[k])) * v
            if k == "norm":
                (q,) = factors[k]
                a, c = q * gd, v / q
                factors[k] = [fit(q, a * a, c * c, lr_p)]
                continue
            left, right = (as_matrix(q) for q in factors[k])
            a = left @ gd @ right.T  # A = L G R^T
            c = inverse(left).T @ v @ inverse(right)  # C = L^-T V R^-1
            grams = [(a @ a.T, c @ c.T), (a.T @ a, c.T @ c)]
            factors[k] = [
                fit(q, *(t12 if q.ndim == 2 else (jnp.diag(t12[0]), jnp.diag(t12[1]))), lr_p)
                for q, t12 in zip(factors[k], grams, strict=True)
            ]
    params = dict(params)
    for k in ORDER:
        if k == "norm":
            direction = factors[k][0] ** 2 * m[k]
        else:
            left, right = (as_matrix(q) for q in factors[k])
            direction = left.T @ left @ m[k] @ right.T @ right  # P G = L^T L G R^T R
        direction = direction / jnp.maximum(1.0, jnp.sqrt(jnp.mean(direction**2)) / 1.1)
        decay = wd * params[k] if k in decayed else 0.0
        params[k] = params[k] - lr(t - 1) * (direction + decay)
    return params, mu, factors


def reference_kron(params0, grads, *, p, init_scale, balance_every, **settings):
    """The reference's steps; which of them update the factors (counter >= 1 / p(t)) is decided here, in Python."""
    params = {k: jnp.asarray(params0[f"{k}.0"]) for k in ORDER}
    mu = {k: jnp.zeros_like(v) for k, v in params.items()}
    factors = {}
    for k, tri in TRIANGULAR.items():
        s = init_scale ** (1 / len(tri))
        factors[k] = [s * jnp.eye(d) if t else s * jnp.ones(d) for d, t in zip(params[k].shape, tri, strict=True)]
    # Two compiled steps (factors updated or not): far quicker than eager jax.numpy's one compilation per operation.
    step = jax.jit(partial(reference_step, **settings), static_argnames=("due",))
    state, counter, updates = (params, mu, factors), 0, 0
    history, decisions = [], []
    for t, grad in enumerate(grads, start=1):
        counter += 1
        due = bool(counter >= 1 / p(t))
        balance = due and (updates + 1) % balance_every == 0
        counter, updates = (0, updates + 1) if due else (counter, updates)
        state = step(state, grad, jnp.float32(t), due=due, balance=jnp.bool_(balance))
        decisions.append(due)
        history.append({f"{k}.0": np.asarray(state[0][k]) for k in ORDER})
    return history, decisions


def _schedule(t):
    # Levanter's anneal, hastened: p = 1 for two steps, then exp(-0.5 (t - 2)), never below 0.5.
    return np.clip(np.exp(np.float32(-0.5) * (np.float32(t) - np.float32(2))), np.float32(0.5), np.float32(1))


def test_update_matches_a_plain_jnp_reference_over_steps():
    lr = optax.linear_schedule(0.05, 0.01, 6)
    optimizer = kron(
        lr,
        weight_decay=0.1,
        mask={"w": True, "x": True, "norm": False},
        max_grad_norm=5.0,
        update_probability=lambda t: jnp.clip(jnp.exp(-0.5 * (t.astype(jnp.float32) - 2.0)), 0.5, 1.0),
        max_size_triangular=8,
        balance_every=2,
        precond_update_precision="float32",
        b1=0.9,
        preconditioner_lr=0.3,
        preconditioner_init_scale=0.8,
    )
    params = _params(0)
    rng = np.random.default_rng(1)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params) for _ in range(6)]
    got = run_optimizer(optimizer, params, grads)
    want, decisions = reference_kron(
        flat(params),
        [flat(g) for g in grads],
        p=_schedule,
        init_scale=0.8,
        balance_every=2,
        lr=lr,
        b1=0.9,
        lr_p=0.3,
        max_norm=5.0,
        wd=0.1,
        decayed=("w", "x"),
    )
    # The factors update at steps 1, 2 (balanced first), 4 and 6 (balanced first): 1/p passes 1, then reaches 2.
    assert decisions == [True, True, False, True, False, True]
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=True)):
        assert got_step.keys() == want_step.keys()
        for k in want_step:
            np.testing.assert_allclose(got_step[k], want_step[k], rtol=0, atol=1e-6, err_msg=f"{k} at step {step}")
    # The preconditioner matters: momentum SGD with the same clips ends elsewhere.
    sgd = run_optimizer(
        optax.chain(optax.clip_by_global_norm(5.0), optax.trace(0.9), optax.clip_by_block_rms(1.1), optax.scale(-0.05)),
        params,
        grads,
    )[-1]
    assert np.abs(sgd["w.0"] - got[-1]["w.0"]).max() > 1e-2


def test_layout_merges_cuts_triangular_dimensions_only_and_round_trips():
    settings = dict(min_ndim_triangular=2, merge_small_dims=True, target_merged_dim_size=16)
    x = nt.NamedArray(
        jnp.arange(2 * 3 * 4 * 512, dtype=jnp.float32).reshape(2, 3, 4, 512),
        (Layers, Heads, nt.Axis("head_size", 4), nt.Axis("embed", 512)),
    )
    layout = kron_layout(
        x,
        max_size_triangular=1000,
        memory_save_mode=None,
        partition_grads_into_blocks=True,
        block_size=256,
        **settings,
    )
    # layers is a batch; heads x head_size merge into 12; embed (512) is cut into two triangular blocks of 256.
    assert layout.merged == (12, 512) and layout.block == (12, 256) and layout.count == 4
    assert layout.triangular == (True, True)
    np.testing.assert_array_equal(layout.from_blocks(layout.to_blocks(x.array), x.array.shape), x.array)
    # Above max_size_triangular a dimension is diagonal, and a diagonal dimension is never cut.
    big = kron_layout(
        x, max_size_triangular=300, memory_save_mode=None, partition_grads_into_blocks=True, block_size=256, **settings
    )
    assert big.triangular == (True, False) and big.blocks == (1, 1)
    one = kron_layout(
        x,
        max_size_triangular=1000,
        memory_save_mode="one_diag",
        partition_grads_into_blocks=False,
        block_size=256,
        **settings,
    )
    assert one.triangular == (True, False)
    assert kron_layout(
        x,
        max_size_triangular=1000,
        memory_save_mode="all_diag",
        partition_grads_into_blocks=True,
        block_size=256,
        **settings,
    ).triangular == (False, False)


def test_config_with_levanter_keys_builds_kron():
    config = KronConfig(learning_rate=0.01, warmup=0, max_size_triangular=6, merge_small_dims=False)
    optimizer, _ = build_optimizer(config, 10)
    state = optimizer.init(_params(2))
    # The chain: clip_by_global_norm, then Kron's state: w (5 x 7) has a triangular factor on 5, a diagonal one on 7.
    kron_state = state[0][1]
    assert [tuple(q.shape for q in qs) for qs in kron_state.qs] == [
        ((1, 5),),
        ((1, 5, 5), (1, 7)),
        ((1, 3, 3), (1, 11)),
    ]
    np.testing.assert_array_equal(kron_state.qs[1][0][0], np.eye(5))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"beta1": 1.0}, r"optimizer.beta1 must be in \[0, 1\)"),
        ({"preconditioner_update_probability": 1.5}, r"preconditioner_update_probability must be in \(0, 1\]"),
        ({"memory_save_mode": "smart_one_diag"}, "memory_save_mode: unknown 'smart_one_diag'; use one of null"),
        ({"precond_dtype": "float8"}, "precond_dtype: unknown 'float8'"),
        ({"block_size": 0}, "optimizer.block_size must be at least 1.*e.g. 256"),
        ({"preconditioner_sharding": ("data", None)}, "preconditioner_sharding is not taken.*set it to null"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message):
        KronConfig(**changes)


def test_upper_inverse_equals_lapacks_triangular_solve_alone_and_batched():
    """Kron inverts its factors without LAPACK (whose batched kernel hung a 2-core step): the recursive halves
    and the back substitution give LAPACK's inverse, for one factor and for a vmapped stack of them."""
    from lm_train.optim.kron_factors import upper_inverse

    rng = np.random.default_rng(0)
    for d in (1, 5, 32, 70):
        q = np.triu(rng.normal(size=(3, d, d)) * 0.3) + np.eye(d) * 2.0
        expected = [jax.scipy.linalg.solve_triangular(m, jnp.eye(d), lower=False) for m in jnp.asarray(q, jnp.float32)]
        batched = jax.jit(jax.vmap(upper_inverse))(jnp.asarray(q, jnp.float32))
        for one, want, got in zip(q, expected, batched, strict=True):
            np.testing.assert_allclose(upper_inverse(jnp.asarray(one, jnp.float32)), want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
