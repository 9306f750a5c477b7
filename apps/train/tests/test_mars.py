"""MARS-AdamW against a plain jax.numpy reference of the paper's update; its config and config errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_reference import flat, random_grads, run_optimizer, small_params

from lm_train.config import MarsConfig
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer, weight_decay_mask
from lm_train.optim.mars import mars

DECAYED = {"q.weight.0", "o.weight.0", "up.weight.0"}


def reference_mars(params0, grads, *, lr, b1, b2, gamma, eps, clip, wd):
    """Algorithm 1 of Yuan et al. (2024), MARS-AdamW with exact gradient differences, in plain jnp."""
    p = {k: jnp.asarray(v) for k, v in params0.items()}
    m = {k: jnp.zeros_like(x) for k, x in p.items()}
    v = {k: jnp.zeros_like(x) for k, x in p.items()}
    previous = {k: jnp.zeros_like(x) for k, x in p.items()}
    history = []
    for t, g in enumerate(grads, start=1):
        g = {k: jnp.asarray(x) for k, x in g.items()}
        c = {k: g[k] + gamma * b1 / (1 - b1) * (g[k] - previous[k]) for k in p}
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in c.values()))
        if norm > clip:
            c = {k: x * (clip / norm) for k, x in c.items()}
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * c[k]
            v[k] = b2 * v[k] + (1 - b2) * c[k] ** 2
            step = (m[k] / (1 - b1**t)) / (jnp.sqrt(v[k] / (1 - b2**t)) + eps)
            p[k] = p[k] - lr(t - 1) * (step + (wd * p[k] if k in DECAYED else 0.0))
        previous = g
        history.append({k: np.asarray(x) for k, x in p.items()})
    return history


@pytest.mark.parametrize("clip", [3.0, None], ids=["clipped", "unclipped"])
def test_update_matches_a_plain_jnp_reference_over_steps(clip):
    lr = optax.linear_schedule(0.01, 0.002, 5)
    settings = dict(b1=0.9, b2=0.95, gamma=0.05, eps=1e-8)
    params = small_params(4)
    rng = np.random.default_rng(5)
    grads = [random_grads(params, rng) for _ in range(5)]
    got = run_optimizer(
        mars(lr, **settings, max_grad_norm=clip, weight_decay=0.1, mask=weight_decay_mask), params, grads
    )
    want = reference_mars(
        flat(params), [flat(g) for g in grads], lr=lr, clip=np.inf if clip is None else clip, wd=0.1, **settings
    )
    for got_step, want_step in zip(got, want, strict=True):
        assert got_step.keys() == want_step.keys()
        for k in want_step:
            np.testing.assert_allclose(got_step[k], want_step[k], rtol=0, atol=1e-6, err_msg=k)
    assert all(np.abs(got[-1][k] - flat(params)[k]).max() > 1e-3 for k in want[-1])


def test_the_correction_term_changes_the_update():
    """gamma = 0 is AdamW on the clipped gradient; gamma > 0 is not (so the reference test sees the correction)."""
    params = small_params(6)
    rng = np.random.default_rng(7)
    grads = [random_grads(params, rng) for _ in range(2)]
    plain = run_optimizer(mars(0.01, gamma=0.0, max_grad_norm=None), params, grads)[-1]
    adam = run_optimizer(optax.adam(0.01, b1=0.95, b2=0.99), params, grads)[-1]
    corrected = run_optimizer(mars(0.01, gamma=0.025, max_grad_norm=None), params, grads)[-1]
    for k in plain:
        np.testing.assert_allclose(plain[k], adam[k], rtol=0, atol=1e-6)
    assert any(np.abs(corrected[k] - plain[k]).max() > 1e-4 for k in plain)


def test_config_with_levanter_keys_builds_mars_and_adds_no_second_clip():
    config = MarsConfig(learning_rate=0.01, warmup=0, lr_schedule="constant", max_grad_norm=0.5, weight_decay=0.0)
    optimizer, _ = build_optimizer(config, 10)
    params = small_params(8)
    grads = [random_grads(params, np.random.default_rng(9)) for _ in range(2)]
    got = run_optimizer(optimizer, params, grads)[-1]
    want = run_optimizer(mars(0.01, max_grad_norm=0.5), params, grads)[-1]
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"beta1": 1.0}, r"optimizer.beta1 must be in \[0, 1\)"),
        ({"beta2": -0.1}, r"optimizer.beta2 must be in \[0, 1\)"),
        ({"gamma": -0.5}, "optimizer.gamma must be non-negative.*gamma: 0.025"),
        ({"epsilon": 0.0}, "optimizer.epsilon must be positive"),
        ({"max_grad_norm": -1.0}, "optimizer.max_grad_norm must be positive"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message):
        MarsConfig(**changes)
