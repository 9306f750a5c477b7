"""DoReMi's pieces against plain numpy: the excess losses, the weight update, the config checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lm_train.config.doremi_config import DoremiConfig
from lm_train.errors import ConfigError
from lm_train.post.doremi.training import check_doremi_config
from lm_train.post.doremi.weights import excess_losses, initial_domain_weights, updated_weights


def _numpy_excess(proxy, reference, mask, domains, k):
    out = np.zeros(k)
    for i in range(k):
        rows = domains == i
        tokens = mask[rows].sum()
        if tokens:
            out[i] = (np.maximum(proxy[rows] - reference[rows], 0) * mask[rows]).sum() / tokens
    return out


def _numpy_update(weights, excess, trained, step_size, smoothing):
    stepped = weights * np.exp(step_size * excess)  # Xie et al. 2023, Algorithm 1, as written
    stepped = stepped / stepped.sum()
    uniform = trained / trained.sum()
    return (1 - smoothing) * stepped + smoothing * uniform


def test_excess_losses_and_weight_updates_equal_the_plain_formula():
    rng = np.random.default_rng(0)
    k, trained = 4, np.array([1.0, 1.0, 0.0, 1.0])  # domain 2 is evaluation-only: never drawn, weight stays 0
    weights = np.asarray(initial_domain_weights(jnp.asarray(trained > 0)).weights)
    np.testing.assert_allclose(weights, [1 / 3, 1 / 3, 0, 1 / 3])
    expected = weights.astype(np.float64)
    for step in range(6):
        proxy = rng.uniform(0, 6, (8, 5)).astype(np.float32)
        reference = rng.uniform(0, 6, (8, 5)).astype(np.float32)
        mask = np.ones((8, 5), bool)
        mask[:, -1] = False
        domains = rng.choice([0, 1, 3] if step % 2 else [0, 3], 8).astype(np.int32)  # domain 1 absent every other step
        excess = np.asarray(excess_losses(proxy, reference, mask, domains, k))
        np.testing.assert_allclose(excess, _numpy_excess(proxy, reference, mask, domains, k), rtol=1e-6, atol=1e-6)
        assert excess[2] == 0 and (step % 2 or excess[1] == 0)
        weights = np.asarray(updated_weights(jnp.asarray(weights), jnp.asarray(excess), trained, 2.0, 0.05))
        expected = _numpy_update(expected, excess.astype(np.float64), trained, 2.0, 0.05)
        np.testing.assert_allclose(weights, expected, rtol=1e-5)
        assert weights[2] == 0 and weights.sum() == pytest.approx(1.0, abs=1e-6)
    # Larger excess earns weight; the smoothing keeps every trained domain above smoothing / domains.
    big = np.asarray(updated_weights(jnp.full(4, 0.25), jnp.asarray([5.0, 0.0, 0.0, 0.0]), np.ones(4), 1.0, 0.1))
    assert big[0] > 0.9 and big[1:].min() >= 0.1 / 4 - 1e-7


def test_doremi_config_errors_name_the_key_and_the_fix(make_config, tmp_path):
    with pytest.raises(ConfigError, match=r"doremi\.step_size"):
        DoremiConfig(step_size=0)
    with pytest.raises(ConfigError, match=r"doremi\.smoothing"):
        DoremiConfig(smoothing=1.0)
    with pytest.raises(ConfigError, match=r"data\.configs is empty: lm-train doremi reweights"):
        check_doremi_config(make_config())
    two = ["--data.builtin", "null", "--data.configs", "{a: {train_urls: [a.jsonl]}, b: {train_urls: [b.jsonl]}}"]
    with pytest.raises(ConfigError, match="--reference CHECKPOINT"):
        check_doremi_config(make_config(*two))
    with pytest.raises(ConfigError, match="two or more trained domains"):
        check_doremi_config(make_config(*two, "--data.train_weights", "{a: 1, b: 0}"))
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"doremi.reference_model_path \(lm-train doremi --reference\): .*nope"):
        check_doremi_config(make_config(*two, "--doremi.reference_model_path", missing))
