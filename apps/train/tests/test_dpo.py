"""DPO: the loss and its metrics against plain jax.numpy, sequence log-probs against log_softmax of the logits,
and one train step with a frozen reference against a plain gradient of the same loss."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from lm_train.config.dpo_config import DpoConfig
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer
from lm_train.post.dpo.loss import DPO_METRICS, dpo_loss, dpo_objective, sequence_log_probs
from lm_train.post.dpo.training import check_dpo_config
from lm_train.run.batch import TokenBatch
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_model, init_state
from lm_train.run.step import StepSettings, make_train_step

VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)
BETA = 0.3


def plain_log_probs(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> jax.Array:
    """sum over t of log softmax(logits[t])[ids[t + 1]] where mask[t]: the definition, in plain jax.numpy."""
    log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)[:, :-1]
    picked = jnp.take_along_axis(log_probs, jnp.asarray(ids)[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(jnp.asarray(mask)[:, :-1], picked, 0.0), axis=-1)


def plain_dpo(pc, pr, rc, rr, beta, valid):
    """The DPO loss of the paper, -log sigmoid(beta * log-ratio difference), averaged over the valid pairs."""
    logits = beta * ((pc - pr) - (rc - rr))
    losses = jnp.log1p(jnp.exp(-logits))
    return jnp.sum(jnp.where(valid, losses, 0.0)) / jnp.sum(valid.astype(jnp.float32))


def test_dpo_loss_and_metrics_equal_plain_formulas():
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (jnp.asarray(rng.normal(-20, 5, size=12), jnp.float32) for _ in range(4))
    valid = jnp.asarray(rng.random(12) < 0.75)
    loss, metrics = dpo_loss(pc, pr, rc, rr, BETA, valid)
    np.testing.assert_allclose(float(loss), float(plain_dpo(pc, pr, rc, rr, BETA, valid)), rtol=1e-6)
    assert sorted(metrics) == sorted(DPO_METRICS)
    v = np.asarray(valid)
    chosen, rejected = BETA * (np.asarray(pc) - np.asarray(rc)), BETA * (np.asarray(pr) - np.asarray(rr))
    expected = {
        "dpo/accuracy": np.mean(chosen[v] > rejected[v]),
        "dpo/reward_margin": np.mean(chosen[v] - rejected[v]),
        "dpo/chosen_reward": np.mean(chosen[v]),
        "dpo/rejected_reward": np.mean(rejected[v]),
        "dpo/chosen_logp": np.mean(np.asarray(pc)[v]),
        "dpo/rejected_logp": np.mean(np.asarray(pr)[v]),
    }
    for name, value in expected.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, atol=1e-6, err_msg=name)
    # Equal log-ratios: the loss is log 2 and no pair is counted as won; no valid pair: 0, not NaN.
    same, _ = dpo_loss(pc, pr, pc, pr, BETA)
    np.testing.assert_allclose(float(same), np.log(2.0), rtol=1e-6)
    empty, empty_metrics = dpo_loss(pc, pr, rc, rr, BETA, jnp.zeros(12, bool))
    assert float(empty) == 0.0 and all(np.isfinite(float(v)) for v in empty_metrics.values())


def _pairs(seed: int, batch: int = 8, length: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for prefix in ("", "rejected_"):
        out[prefix + "input_ids"] = rng.integers(0, VOCAB, size=(batch, length), dtype=np.int32)
        mask = np.zeros((batch, length), bool)
        for row, start in enumerate(rng.integers(2, length - 4, size=batch)):
            mask[row, start : rng.integers(start + 1, length)] = True
        out[prefix + "loss_mask"] = mask
    out["loss_mask"][0] = False  # pair 0 has no chosen target: it counts for nothing
    return out


def _named(arrays: dict[str, np.ndarray]) -> TokenBatch:
    named = {k: nt.named(jnp.asarray(v), ("batch", "position")) for k, v in arrays.items()}
    extra = {k: v for k, v in named.items() if k.startswith("rejected_")}  # what DPO adds to the batch
    return TokenBatch(named["input_ids"], named["loss_mask"], extra=extra)


def test_sequence_log_probs_equal_log_softmax_of_the_logits(make_config):
    config = make_config()
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    model = init_model(config, plan, Vocab)
    pairs = _pairs(1)
    ids, mask = pairs["input_ids"], pairs["loss_mask"]
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        ours = sequence_log_probs(model, nt.named(jnp.asarray(ids), ("batch", "position")), _named(pairs).loss_mask)
        logits = nt.permute(model(nt.named(jnp.asarray(ids), ("batch", "position"))), ("batch", "position", "vocab"))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(plain_log_probs(logits.array, ids, mask)), rtol=2e-5)
    assert float(ours[0]) == 0.0 and np.all(np.asarray(ours[1:]) < 0)


def test_dpo_step_equals_a_plain_gradient_and_leaves_the_reference(make_config):
    config = make_config("--trainer.seed", "3")
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    reference = init_model(make_config("--trainer.seed", "4"), plan, Vocab)  # another model: log-ratios differ
    state = dataclasses.replace(state, frozen=reference)
    settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0)
    step = make_train_step(optimizer, settings, schedule, objective=dpo_objective(BETA))
    pairs = _pairs(2)
    reference_before = jax.tree_util.tree_map(np.asarray, eqx.filter(reference, eqx.is_array))
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        new_state, metrics = jax.jit(step)(state, _named(pairs))

    params, static = eqx.partition(state.model, eqx.is_inexact_array)

    def scores(model, prefix: str) -> jax.Array:
        ids = pairs[prefix + "input_ids"]
        logits = nt.permute(model(nt.named(jnp.asarray(ids), ("batch", "position"))), ("batch", "position", "vocab"))
        return plain_log_probs(logits.array, ids, pairs[prefix + "loss_mask"])

    def plain(p):
        model = eqx.combine(p, static)
        rc, rr = scores(reference, ""), scores(reference, "rejected_")
        valid = pairs["loss_mask"].any(-1) & pairs["rejected_loss_mask"].any(-1)
        return plain_dpo(scores(model, ""), scores(model, "rejected_"), rc, rr, BETA, jnp.asarray(valid))

    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        loss, grads = jax.jit(jax.value_and_grad(plain))(params)
    np.testing.assert_allclose(float(metrics["train/loss"]), float(loss), rtol=1e-5)
    grad_norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(grads))))
    np.testing.assert_allclose(float(metrics["optim/grad_norm"]), grad_norm, rtol=1e-4)
    assert set(DPO_METRICS) <= set(metrics) and float(loss) != pytest.approx(np.log(2.0), abs=1e-3)
    after = jax.tree_util.tree_map(np.asarray, eqx.filter(new_state.frozen, eqx.is_array))
    leaves = zip(jax.tree.leaves(reference_before), jax.tree.leaves(after), strict=True)
    assert all(np.array_equal(a, b) for a, b in leaves)
    assert int(new_state.step) == 1 and new_state.checkpointed().frozen is None


def test_dpo_config_rejects_bad_values():
    with pytest.raises(ConfigError, match=r"dpo\.beta must be a positive number"):
        DpoConfig(beta=0)
    with pytest.raises(ConfigError, match="use one of preference, preference_chat"):
        DpoConfig(format="chat")
    with pytest.raises(ConfigError, match=r"preference_chat only"):
        DpoConfig(chat_template="{{ x }}")


def test_dpo_checks_what_it_needs_of_the_rest_of_the_config(make_config):
    pairs = ["--data.builtin", "null", "--data.train_urls", "[pairs.jsonl]", "--data.tokenizer", "tokenizer.json"]
    check_dpo_config(make_config(*pairs))  # a pair source and a tokenizer: fine
    cases = {
        "data.builtin, data.id and mixtures": [],  # gpt2_nano trains on the built-in corpus
        "data.tokenizer is empty": [*pairs[:4]],
        "does not evaluate validation pairs": [*pairs, "--data.validation_urls", "[valid.jsonl]"],
        "use optimizer.type: adam": [*pairs, "--optimizer.type", "sophia-g"],
        "z_loss_weight": [*pairs, "--z_loss_weight", "1e-4"],
        "forgetful causal masking": [*pairs, "--fcm_prob", "0.15"],
    }
    for expected, overrides in cases.items():
        with pytest.raises(ConfigError, match=expected):
            check_dpo_config(make_config(*overrides))
