"""Sophia against a NumPy reference of the paper's equations; both Hessian estimators; jit, NamedArray pytrees."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import named_tensors as nt
from lm_train.config import OptimizerConfig, SophiaGConfig, SophiaHConfig
from lm_train.config.optimizer_config import GAMMA_SOPHIA_G, GAMMA_SOPHIA_H
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer
from lm_train.optim import hessian as H
from lm_train.optim import sophia as S


def _standard():
    # optax mixes python floats and int32 counts: it is not written for strict dtype promotion.
    return jax.numpy_dtype_promotion("standard")


# -- the update against the equations ----------------------------------------------------------------------


def test_update_matches_numpy_reference_over_steps():
    b1, b2, gamma, eps, wd, k = 0.9, 0.8, 0.5, 1e-3, 0.1, 3
    schedule = optax.linear_schedule(0.1, 0.02, 8)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(4,)).astype(np.float32)}
    mask = {"w": True, "b": False}
    opt = S.sophia(schedule, b1=b1, b2=b2, gamma=gamma, eps=eps, weight_decay=wd, mask=mask, update_hessian_every=k)
    jparams = jax.tree_util.tree_map(jnp.asarray, params)
    with _standard():
        state = opt.init(jparams)

    ref = {name: p.copy() for name, p in params.items()}
    m = {name: np.zeros_like(p) for name, p in params.items()}
    h = {name: np.zeros_like(p) for name, p in params.items()}
    fractions = []
    for t in range(8):
        grads = {name: rng.normal(size=p.shape).astype(np.float32) for name, p in params.items()}
        # Some estimates are negative or tiny (Hutchinson's can be): those coordinates hit the eps floor and clip.
        h_hat = {name: rng.normal(loc=1.0, scale=2.0, size=p.shape).astype(np.float32) for name, p in params.items()}

        assert bool(S.hessian_update_due(state)) == (t % k == 0)
        state = S.maybe_update_hessian(state, lambda h_hat=h_hat: jax.tree_util.tree_map(jnp.asarray, h_hat))
        with _standard():
            updates, state = opt.update(jax.tree_util.tree_map(jnp.asarray, grads), state, jparams)
            jparams = optax.apply_updates(jparams, updates)

        lr = float(schedule(t))
        unclipped, total = 0, 0
        for name in params:
            if t % k == 0:
                h[name] = b2 * h[name] + (1 - b2) * h_hat[name]
            m[name] = b1 * m[name] + (1 - b1) * grads[name]
            ratio = m[name] / np.maximum(gamma * h[name], eps)
            unclipped += int(np.sum(np.abs(ratio) < 1))
            total += ratio.size
            decay = wd * ref[name] if mask[name] else 0.0
            ref[name] = ref[name] - lr * (np.clip(ratio, -1, 1) + decay)
        fractions.append(unclipped / total)
        for name in params:
            np.testing.assert_allclose(np.asarray(jparams[name]), ref[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(S.unclipped_fraction(state)), unclipped / total, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(S.sophia_state(state).hessian["w"]), h["w"], rtol=1e-5, atol=1e-7)
    # The clip was active on some coordinates and not on others.
    assert any(0.0 < f < 1.0 for f in fractions)


def test_update_is_bounded_by_lr_and_sign_of_momentum():
    opt = S.sophia(0.5, gamma=1.0, update_hessian_every=1)
    params = {"w": jnp.zeros(4)}
    with _standard():
        state = opt.init(params)
        # No Hessian yet: h = 0, every coordinate clips to a sign step of size lr.
        updates, state = opt.update({"w": jnp.array([1e6, -1e-6, 3.0, -2.0])}, state, params)
    np.testing.assert_allclose(np.asarray(updates["w"]), [-0.5, 0.5, -0.5, 0.5])
    assert float(S.unclipped_fraction(state)) == 0.0


# -- estimators ---------------------------------------------------------------------------------------------


def _quadratic(a: jax.Array):
    return lambda p: 0.5 * jnp.dot(p["x"], a @ p["x"])


def test_hutchinson_is_exact_for_diagonal_quadratic_with_rademacher():
    diag = jnp.array([1.0, -2.0, 3.5, 0.25])
    params = {"x": jnp.array([0.3, -1.0, 2.0, 0.5])}
    est = H.hutchinson_diagonal(_quadratic(jnp.diag(diag)), params, jax.random.key(1), distribution="rademacher")
    np.testing.assert_allclose(np.asarray(est["x"]), np.asarray(diag), rtol=1e-6)


def test_hutchinson_averages_to_the_diagonal():
    rng = np.random.default_rng(1)
    b = rng.normal(size=(5, 5)).astype(np.float32)
    a = jnp.asarray((b + b.T) / 2)
    params = {"x": jnp.asarray(rng.normal(size=5).astype(np.float32))}
    keys = jax.random.split(jax.random.key(2), 20000)
    samples = jax.jit(jax.vmap(lambda k: H.hutchinson_diagonal(_quadratic(a), params, k)["x"]))(keys)
    np.testing.assert_allclose(np.asarray(jnp.mean(samples, axis=0)), np.diag(np.asarray(a)), atol=0.1)


def _softmax_regression_data(n=6, d=3, c=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    params = {"w": rng.normal(size=(d, c)).astype(np.float32), "b": rng.normal(size=(c,)).astype(np.float32)}
    return x, params


def test_gauss_newton_bartlett_matches_direct_computation():
    x, params = _softmax_regression_data()
    mask = np.array([1, 1, 0, 1, 1, 0], dtype=bool)
    key = jax.random.key(3)
    jparams = jax.tree_util.tree_map(jnp.asarray, params)

    def logits_fn(p):
        return jnp.asarray(x) @ p["w"] + p["b"][None, :]

    est = H.gauss_newton_bartlett_diagonal(logits_fn, jparams, key, mask=jnp.asarray(mask))

    # Direct: the labels sampled with the same key, then softmax-regression gradients by hand.
    labels = np.asarray(jax.random.categorical(key, logits_fn(jparams), axis=-1))
    logits = x @ params["w"] + params["b"][None, :]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    delta = (p - np.eye(p.shape[1])[labels]) * mask[:, None]
    count = mask.sum()
    g_w = x.T @ delta / count
    g_b = delta.sum(0) / count
    np.testing.assert_allclose(np.asarray(est["w"]), count * g_w**2, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(est["b"]), count * g_b**2, rtol=1e-4, atol=1e-7)


def test_gauss_newton_bartlett_averages_to_the_gauss_newton_diagonal():
    # One example: E over sampled labels of g * g is diag(J^T (diag(p) - p p^T) J) = x_i^2 p_c (1 - p_c).
    x, params = _softmax_regression_data(n=1)
    jparams = jax.tree_util.tree_map(jnp.asarray, params)

    def logits_fn(p):
        return jnp.asarray(x) @ p["w"] + p["b"][None, :]

    keys = jax.random.split(jax.random.key(10), 20000)
    samples = jax.jit(jax.vmap(lambda k: H.gauss_newton_bartlett_diagonal(logits_fn, jparams, k)))(keys)
    logits = (x @ params["w"] + params["b"][None, :])[0]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    np.testing.assert_allclose(np.asarray(jnp.mean(samples["b"], axis=0)), p * (1 - p), atol=0.01)
    expected_w = x[0][:, None] ** 2 * (p * (1 - p))[None, :]
    np.testing.assert_allclose(np.asarray(jnp.mean(samples["w"], axis=0)), expected_w, atol=0.02)


def test_gauss_newton_bartlett_accepts_named_logits():
    x, params = _softmax_regression_data()
    key = jax.random.key(4)
    jparams = jax.tree_util.tree_map(jnp.asarray, params)
    plain = H.gauss_newton_bartlett_diagonal(lambda p: jnp.asarray(x) @ p["w"] + p["b"][None, :], jparams, key)
    # Vocab first: the estimator must find it by name, not by position.
    named = H.gauss_newton_bartlett_diagonal(
        lambda p: nt.named((jnp.asarray(x) @ p["w"] + p["b"][None, :]).T, ("vocab", "batch")), jparams, key
    )
    for name in params:
        np.testing.assert_allclose(np.asarray(named[name]), np.asarray(plain[name]), rtol=1e-5, atol=1e-8)


# -- jit and named pytrees ----------------------------------------------------------------------------------


class _Tiny(eqx.Module):
    w: nt.NamedArray
    b: nt.NamedArray
    scale: float = eqx.field(static=True, default=1.0)

    def __call__(self, x: jax.Array) -> nt.NamedArray:
        return nt.named(self.scale * (x @ self.w.array + self.b.array[None, :]), ("batch", "vocab"))


def _tiny_model(d=3, c=4):
    w = jax.random.normal(jax.random.key(5), (d, c))
    return _Tiny(w=nt.named(w, ("embed", "vocab")), b=nt.named(jnp.zeros(c), ("vocab",)))


@pytest.mark.parametrize("config_cls", [SophiaHConfig, SophiaGConfig])
def test_train_step_under_jit_on_equinox_module_with_named_arrays(config_cls):
    x, _ = _softmax_regression_data(n=8)
    x = jnp.asarray(x)
    y = jnp.arange(8, dtype=jnp.int32) % 4
    model = _tiny_model()
    config = config_cls(learning_rate=0.1, warmup=0, lr_schedule="constant", update_hessian_every=2)
    opt, _ = build_optimizer(config, 10)

    def loss_fn(m):
        logp = jax.nn.log_softmax(m(x).array, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    def step(m, state, key):
        if config.estimator == "hutchinson":
            estimate = lambda: H.hutchinson_diagonal(loss_fn, m, key)  # noqa: E731
        else:
            estimate = lambda: H.gauss_newton_bartlett_diagonal(lambda p: p(x), m, key)  # noqa: E731
        state = S.maybe_update_hessian(state, estimate)
        loss, grads = jax.value_and_grad(loss_fn)(m)
        with _standard():
            updates, state = opt.update(grads, state, m)
            m = optax.apply_updates(m, updates)
        return m, state, loss

    with _standard():
        state = opt.init(model)
    eager = step(model, state, jax.random.key(6))
    jitted = jax.jit(step)
    m, state_j, _ = jitted(model, state, jax.random.key(6))
    assert isinstance(m.w, nt.NamedArray) and m.w.axis_names == ("embed", "vocab")
    np.testing.assert_allclose(np.asarray(m.w.array), np.asarray(eager[0].w.array), rtol=1e-5, atol=1e-7)
    h0 = S.sophia_state(state_j).hessian
    assert isinstance(h0.w, nt.NamedArray) and float(jnp.max(jnp.abs(h0.w.array))) > 0
    # Step 1 is not a refresh step (k = 2): h is unchanged; step 2 refreshes it.
    m, state_j, _ = jitted(m, state_j, jax.random.key(7))
    np.testing.assert_array_equal(np.asarray(S.sophia_state(state_j).hessian.w.array), np.asarray(h0.w.array))
    m, state_j, _ = jitted(m, state_j, jax.random.key(8))
    assert not np.array_equal(np.asarray(S.sophia_state(state_j).hessian.w.array), np.asarray(h0.w.array))
    assert 0.0 <= float(S.unclipped_fraction(state_j)) <= 1.0


# -- the loss falls -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["hutchinson", "gauss_newton_bartlett"])
def test_loss_falls_on_a_small_mlp(estimator):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(128, 8)).astype(np.float32))
    teacher = rng.normal(size=(8, 4)).astype(np.float32)
    y = jnp.asarray(np.argmax(np.asarray(x) @ teacher, axis=-1).astype(np.int32))
    k1, k2 = jax.random.split(jax.random.key(8))
    params = {
        "w1": 0.5 * jax.random.normal(k1, (8, 16)),
        "b1": jnp.zeros(16),
        "w2": 0.5 * jax.random.normal(k2, (16, 4)),
        "b2": jnp.zeros(4),
    }

    def logits_fn(p):
        return jnp.tanh(x @ p["w1"] + p["b1"][None, :]) @ p["w2"] + p["b2"][None, :]

    def loss_fn(p):
        logp = jax.nn.log_softmax(logits_fn(p), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    gamma = GAMMA_SOPHIA_H if estimator == "hutchinson" else GAMMA_SOPHIA_G
    opt = S.sophia(0.05, gamma=gamma, weight_decay=1e-3)

    def step(carry, key):
        p, state = carry
        if estimator == "hutchinson":
            state = S.maybe_update_hessian(state, lambda: H.hutchinson_diagonal(loss_fn, p, key))
        else:
            state = S.maybe_update_hessian(state, lambda: H.gauss_newton_bartlett_diagonal(logits_fn, p, key))
        loss, grads = jax.value_and_grad(loss_fn)(p)
        with _standard():
            updates, state = opt.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        return (p, state), loss

    with _standard():
        state = opt.init(params)
    (params, _), losses = jax.jit(lambda c, ks: jax.lax.scan(step, c, ks))(
        (params, state), jax.random.split(jax.random.key(9), 100)
    )
    first, last = float(losses[0]), float(loss_fn(params))
    assert np.isfinite(last) and last < 0.5 * first, (first, last)


# -- configuration ------------------------------------------------------------------------------------------


def test_configs_are_registered_with_paper_defaults():
    assert OptimizerConfig.get_choice_class("sophia-h") is SophiaHConfig
    assert OptimizerConfig.get_choice_class("sophia-g") is SophiaGConfig
    h, g = SophiaHConfig(), SophiaGConfig()
    assert (h.beta1, h.beta2, h.epsilon, h.update_hessian_every) == (0.96, 0.99, 1e-12, 10)
    assert (h.gamma, g.gamma) == (0.01, 0.05)
    with pytest.raises(ConfigError, match=r"optimizer\.beta2"):
        SophiaGConfig(beta2=1.0)
    with pytest.raises(ConfigError, match=r"optimizer\.update_hessian_every"):
        SophiaHConfig(update_hessian_every=0)


def test_nano_overlay_selects_sophia_g():
    from pathlib import Path

    from lm_train.config import load_train_config

    root = Path(__file__).resolve().parents[3]
    config, _ = load_train_config([root / "configs/gpt2_nano.yaml", root / "configs/gpt2_nano_sophia.yaml"])
    assert isinstance(config.optimizer, SophiaGConfig)
    assert config.optimizer.learning_rate == 2e-3 and config.optimizer.update_hessian_every == 10
