"""RL's objective against plain numpy: GRPO, Dr. GRPO and GSPO losses, clip fraction, KL and the log-prob mismatch
on a tiny model, with old log-probs moved off the model's so that clipping is active; and group advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from lm_train.post.rl.objective import ADVANTAGE, FRESH, OLD_LOGPROB, group_advantages, rl_objective
from lm_train.run.batch import TokenBatch

B, T, V, EPS, MAX_NEW = 6, 8, 16, 0.2, 5


@pytest.fixture(scope="module")
def setup():
    config = lm.Gpt2Config(seq_len=T, hidden_dim=16, num_heads=2, num_layers=1, gradient_checkpointing=False)
    model = lm.inference_mode(config.build(nt.Axis("vocab", V), key=jax.random.key(0)))
    reference = lm.inference_mode(config.build(nt.Axis("vocab", V), key=jax.random.key(1)))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = np.zeros((B, T), bool)
    for row in range(B):  # completions of 1..5 tokens after a 2-token prompt
        mask[row, 1 : 2 + row % MAX_NEW] = True

    # Plain jax.numpy log-probs of each next token, from the models' logits.
    def log_probs(m):
        logits = nt.permute(m(nt.named(jnp.asarray(ids), ("batch", "position"))), ("batch", "position", "vocab"))
        lp = np.asarray(jax.nn.log_softmax(logits.array.astype(jnp.float32), axis=-1))
        out = np.zeros((B, T), np.float32)
        out[:, :-1] = np.take_along_axis(lp[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
        return out * mask

    new, ref = log_probs(model), log_probs(reference)
    old = (new + rng.normal(0, 0.3, (B, T)).astype(np.float32)) * mask  # ratios well off 1: clipping happens
    advantage = rng.normal(0, 1, B).astype(np.float32)
    names = ("batch", "position")
    batch = TokenBatch(
        nt.named(jnp.asarray(ids), names),
        loss_mask=nt.named(jnp.asarray(mask), names),
        extra={ADVANTAGE: nt.named(jnp.asarray(advantage), ("batch",)), OLD_LOGPROB: nt.named(jnp.asarray(old), names)},
    )
    return model, reference, batch, dict(mask=mask, new=new, ref=ref, old=old, advantage=advantage)


def _expected(loss: str, kl_coef: float, d: dict) -> tuple[float, float, float, float]:
    m, a = d["mask"].astype(np.float64), d["advantage"].astype(np.float64)
    delta = (d["new"] - d["old"]).astype(np.float64) * m
    if loss == "gspo":
        ratio = np.exp(delta.sum(-1) / m.sum(-1))
        pg = -np.mean(np.minimum(ratio * a, np.clip(ratio, 1 - EPS, 1 + EPS) * a))
        clipped = np.mean(np.abs(ratio - 1) > EPS)
    else:
        ratio = np.exp(delta)
        per_token = np.minimum(ratio * a[:, None], np.clip(ratio, 1 - EPS, 1 + EPS) * a[:, None]) * m
        pg = -np.mean(per_token.sum(-1) / m.sum(-1)) if loss == "grpo" else -per_token.sum() / (B * MAX_NEW)
        clipped = ((np.abs(ratio - 1) > EPS) * m).sum() / m.sum()
    log_ratio = (d["ref"] - d["new"]) * m
    kl = ((np.exp(log_ratio) - log_ratio - 1) * m).sum() / m.sum()
    return pg + kl_coef * kl, clipped, kl, np.abs(delta).max()


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "gspo"])
def test_objective_matches_numpy(setup, loss):
    model, reference, batch, d = setup
    kl_coef = 0.5
    value, metrics, state = rl_objective(loss, EPS, kl_coef, MAX_NEW)(model, batch, None, reference)
    total, clipped, kl, mismatch = _expected(loss, kl_coef, d)
    assert state is None
    assert 0 < clipped < 1  # some ratios are clipped, some are not
    np.testing.assert_allclose(float(value), total, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["rl/clip_fraction"]), clipped, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rl/kl"]), kl, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(float(metrics["rl/logprob_mismatch"]), mismatch, rtol=1e-4, atol=1e-6)


def test_logprob_mismatch_reads_only_rows_of_a_batchs_first_update(setup):
    """With several updates per batch, the rows that later updates train on are off-policy on purpose: only the
    fresh rows' log-probs are compared with the sampler's; the loss and clip fraction still read every row."""
    model, reference, batch, d = setup
    delta = np.abs(d["new"] - d["old"]) * d["mask"]
    fresh = (delta.max(axis=1) < delta.max()).astype(np.float32)  # every row but the one farthest off
    extra = dict(batch.extra) | {FRESH: nt.named(jnp.asarray(fresh), ("batch",))}
    marked = TokenBatch(batch.input_ids, loss_mask=batch.loss_mask, extra=extra)
    objective = rl_objective("grpo", EPS, 0.0, MAX_NEW)
    value, metrics, _ = objective(model, marked, None, reference)
    plain_value, plain_metrics, _ = objective(model, batch, None, reference)
    expected = delta[fresh == 1].max()
    assert expected < delta.max()  # the comparison can tell the two apart
    np.testing.assert_allclose(float(metrics["rl/logprob_mismatch"]), expected, rtol=1e-4, atol=1e-6)
    assert float(value) == float(plain_value)
    assert float(metrics["rl/clip_fraction"]) == float(plain_metrics["rl/clip_fraction"])


def test_group_advantages():
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    plain = group_advantages(rewards, 4, scale_by_std=False)
    np.testing.assert_allclose(plain, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    scaled = group_advantages(rewards, 4, scale_by_std=True)
    np.testing.assert_allclose(scaled[:4], plain[:4] / np.std([1.0, 0, 0, 0]), rtol=1e-5)
    assert not scaled[4:].any()  # a group that scores alike has no advantage
