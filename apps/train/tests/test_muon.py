"""Muon against a plain jax.numpy reference of its update; which parameters it takes; its config errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optim_reference import Embed, Vocab, flat, random_grads, run_optimizer, small_params

from lm_train.config import MuonConfig, load_train_config
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer, weight_decay_mask
from lm_train.optim.muon import muon, muon_labels, newton_schulz
from named_tensors.nn import Linear

# Each parameter as the reference sees it: Muon's as a stack of (Out, In) matrices, AdamW's as they are.
MATRICES = {"q.weight.0": (2, 6, 8), "o.weight.0": (2, 8, 6), "up.weight.0": (1, 4, 8)}
ADAM = ("up.bias.0", "tokens.0", "norm.0")
DECAYED = {"q.weight.0", "o.weight.0", "up.weight.0"}


def reference_newton_schulz(g, steps, coefficients, eps):
    a, b, c = coefficients
    x = g / (jnp.sqrt(jnp.sum(g * g)) + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_muon(params0, grads, *, lr, adam_lr, momentum, nesterov, steps, coefficients, eps, wd, b1, b2, clip):
    """Muon's paper update (Jordan et al. 2024) and AdamW, step by step in plain jnp on flat arrays."""
    p = {k: jnp.asarray(v) for k, v in params0.items()}
    buf = {k: jnp.zeros(MATRICES[k]) for k in MATRICES}
    m = {k: jnp.zeros_like(p[k]) for k in ADAM}
    v = {k: jnp.zeros_like(p[k]) for k in ADAM}
    history = []
    for t, g in enumerate(grads, start=1):
        for k, shape in MATRICES.items():
            gk = jnp.asarray(g[k]).reshape(shape)
            buf[k] = momentum * buf[k] + gk
            d = momentum * buf[k] + gk if nesterov else buf[k]
            rows, cols = shape[1:]
            o = jnp.stack([reference_newton_schulz(d[i], steps, coefficients, eps) for i in range(shape[0])])
            o = o * np.sqrt(max(1.0, rows / cols))
            p[k] = p[k] - lr(t - 1) * (o.reshape(p[k].shape) + wd * p[k])
        norm = jnp.sqrt(sum(jnp.sum(jnp.asarray(g[k]) ** 2) for k in ADAM))
        scale = jnp.minimum(1.0, clip / norm)
        for k in ADAM:
            gk = jnp.asarray(g[k]) * scale
            m[k] = b1 * m[k] + (1 - b1) * gk
            v[k] = b2 * v[k] + (1 - b2) * gk * gk
            step = (m[k] / (1 - b1**t)) / (jnp.sqrt(v[k] / (1 - b2**t)) + 1e-8)
            p[k] = p[k] - adam_lr(t - 1) * (step + (wd * p[k] if k in DECAYED else 0.0))
        history.append({k: np.asarray(x) for k, x in p.items()})
    return history


@pytest.mark.parametrize("nesterov", [True, False])
def test_update_matches_a_plain_jnp_reference_over_steps(nesterov):
    lr = optax.linear_schedule(0.05, 0.01, 4)

    def adam_lr(step):
        return lr(step) * 0.2

    settings = dict(momentum=0.9, nesterov=nesterov, steps=5, coefficients=(3.4445, -4.7750, 2.0315))
    params = small_params(0)
    rng = np.random.default_rng(1)
    grads = [random_grads(params, rng) for _ in range(4)]
    optimizer = muon(
        lr, adam_lr, **settings, muon_eps=1e-7, weight_decay=0.1, mask=weight_decay_mask, adam_max_grad_norm=2.0
    )
    got = run_optimizer(optimizer, params, grads)
    want = reference_muon(
        flat(params),
        [flat(g) for g in grads],
        lr=lr,
        adam_lr=adam_lr,
        eps=1e-7,
        wd=0.1,
        b1=0.9,
        b2=0.95,
        clip=2.0,
        **settings,
    )
    for got_step, want_step in zip(got, want, strict=True):
        assert got_step.keys() == want_step.keys()
        for k in want_step:
            np.testing.assert_allclose(got_step[k], want_step[k], rtol=0, atol=1e-6, err_msg=k)
    # The steps really moved the parameters (a reference that agrees with doing nothing would prove nothing).
    assert all(np.abs(got[-1][k] - flat(params)[k]).max() > 1e-3 for k in want[-1])


def test_newton_schulz_orthogonalises():
    """Five quintic steps bring every singular value into the band the coefficients aim at (about 0.7 to 1.2)."""
    g = jnp.asarray(np.random.default_rng(2).normal(size=(6, 10)).astype(np.float32))
    singular = np.linalg.svd(np.asarray(newton_schulz(g, 5, (3.4445, -4.7750, 2.0315), 1e-7)), compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.25


def test_muon_takes_linear_weights_and_leaves_embeddings_heads_norms_biases_to_adamw():
    labels = flat(muon_labels(small_params()))
    assert {k for k, label in labels.items() if label == "muon"} == {"q.weight", "o.weight", "up.weight"}
    # A Linear whose output is the vocabulary is an LM head: AdamW.
    head = Linear(small_params()["tokens"], None, (Embed,), (Vocab,))
    assert muon_labels({"lm_head": head})["lm_head"].weight == "adamw"


def test_config_builds_muon_with_levanter_keys():
    config = MuonConfig(learning_rate=0.02, adam_lr=3e-3, backend_steps=3, coefficient_type="simple", warmup=0)
    assert config.newton_schulz_coefficients == (1.5, -0.5, 0.0)
    optimizer, schedule = build_optimizer(config, 10)
    params = small_params()
    got = run_optimizer(optimizer, params, [random_grads(params, np.random.default_rng(3))])
    assert np.isfinite(got[0]["q.weight.0"]).all()
    assert float(schedule(0)) == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"momentum": 1.0}, r"optimizer.momentum must be in \[0, 1\)"),
        ({"backend_steps": 0}, "optimizer.backend_steps must be at least 1"),
        ({"coefficient_type": "cubic"}, "optimizer.coefficient_type: unknown 'cubic'.*ns_coefficients"),
        ({"adam_lr": 0.0}, "optimizer.adam_lr must be positive"),
        ({"muon_epsilon": -1.0}, "optimizer.muon_epsilon must be positive"),
    ],
)
def test_config_errors_name_the_key_and_the_fix(changes, message):
    with pytest.raises(ConfigError, match=message):
        MuonConfig(**changes)


DATA = "data:\n  train_urls: [train.jsonl]\n  tokenizer: tokenizer.json\n"
MARIN_STYLE = """optimizer:
  type: muon
  learning_rate: 0.02
  adam_lr: 0.004
  momentum: 0.98
  nesterov: false
  backend_steps: 6
  muon_epsilon: 1.0e-5
  use_kimi_scaling: true
  weight_decay: 0.05
  max_grad_norm: 1.0
  lr_schedule: linear
  min_lr_ratio: 0.0
  warmup: 0.0
"""


def test_a_levanter_muon_section_resolves_with_its_own_nesterov(tmp_path):
    path = tmp_path / "muon.yaml"
    path.write_text(DATA + MARIN_STYLE, encoding="utf-8")
    optimizer = load_train_config([path])[0].optimizer
    assert isinstance(optimizer, MuonConfig)
    assert (optimizer.nesterov, optimizer.backend_steps, optimizer.use_kimi_scaling) == (False, 6, True)
    assert (optimizer.adam_lr, optimizer.momentum, optimizer.muon_epsilon) == (0.004, 0.98, 1e-5)
    # Adam has no Nesterov momentum here: for it the key still names the missing feature.
    path.write_text(DATA + "optimizer:\n  nesterov: true\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="Nesterov momentum in Adam"):
        load_train_config([path])


def test_a_wrong_type_names_the_file_key_and_line(tmp_path):
    path = tmp_path / "muon.yaml"
    path.write_text(DATA + MARIN_STYLE.replace("backend_steps: 6", "backend_steps: five"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"muon.yaml:10: bad value for `optimizer.backend_steps`") as error:
        load_train_config([path])
    assert "five" in str(error.value)
