"""Model averaging: the EMA kept in the state against a plain jnp EMA of the weights, its config, its model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from lm_train.errors import CheckpointError, ConfigError, UserError
from lm_train.optim import build_optimizer
from lm_train.run.batch import TokenBatch
from lm_train.run.mesh import plan_mesh
from lm_train.run.model_averaging import (
    averaged_model,
    check_weights,
    chosen_weights,
    exported_model,
    keeps_average,
)
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state, trainable
from lm_train.run.step import StepSettings, make_train_step

VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)
EMA = "{type: ema, beta: 0.8}"


def _ids(seed: int) -> TokenBatch:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(8, 16), dtype=np.int32)
    return TokenBatch(nt.named(jnp.asarray(ids), ("batch", "position")))


def _arrays(tree):
    return [np.asarray(x.array if isinstance(x, nt.NamedArray) else x) for x in jax.tree_util.tree_leaves(tree)]


def test_the_state_keeps_an_ema_of_the_weights_equal_to_a_plain_jnp_ema(make_config):
    config = make_config("--trainer.model_averaging", EMA)
    assert config.trainer.model_averaging.beta == 0.8
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0, ema_beta=0.8)
    step = jax.jit(make_train_step(optimizer, settings, schedule))

    reference = [jnp.asarray(a) for a in _arrays(trainable(state.model))]
    assert all(np.array_equal(a, b) for a, b in zip(_arrays(state.averaged), reference, strict=True))
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        for i in range(4):
            state, _ = step(state, _ids(i))
            weights = _arrays(trainable(state.model))
            reference = [0.8 * r + 0.2 * jnp.asarray(w) for r, w in zip(reference, weights, strict=True)]
    got = _arrays(state.averaged)
    for g, r in zip(got, reference, strict=True):
        np.testing.assert_allclose(g, np.asarray(r), rtol=1e-6, atol=1e-7)
    assert any(not np.allclose(g, w) for g, w in zip(got, weights, strict=True))  # the average lags the weights

    # The averaged model is the model with the averaged weights; export takes it unless export_ema is false.
    model = averaged_model(state.model, state.averaged)
    assert all(np.array_equal(a, b) for a, b in zip(_arrays(trainable(model)), got, strict=True))
    assert exported_model(state, config.trainer.model_averaging) is not state.model
    no_export = make_config("--trainer.model_averaging", "{type: ema, beta: 0.8, export_ema: false}")
    assert exported_model(state, no_export.trainer.model_averaging) is state.model


def test_without_model_averaging_the_state_keeps_none(make_config):
    config = make_config()
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    assert state.averaged is None and config.trainer.model_averaging is None
    assert exported_model(state, None) is state.model


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{type: ema, beta: 1.5}", r"trainer.model_averaging.beta must be in \[0, 1\), got 1.5"),
        ("{type: swa}", r"trainer.model_averaging.type: unknown type .swa.; lm-train has ema"),
        ("{type: ema, decay: 0.9}", r"unknown key `trainer.model_averaging.decay`"),
    ],
)
def test_bad_model_averaging_keys_name_the_key(make_config, value, message):
    with pytest.raises(ConfigError, match=message):
        make_config("--trainer.model_averaging", value)


def test_the_weights_a_checkpoint_tool_uses(make_config):
    """--weights: given, it is taken (ema only where the checkpoint keeps an average); left out, the run's choice."""
    with_average = {"leaves": [{"path": ".model.w[0]"}, {"path": ".averaged.w[0]"}]}
    without = {"leaves": [{"path": ".model.w[0]"}, {"path": ".averaged_not.w[0]"}]}
    on = make_config("--trainer.model_averaging", EMA).trainer.model_averaging
    off = make_config("--trainer.model_averaging", "{type: ema, export_ema: false}").trainer.model_averaging
    assert keeps_average(with_average) and not keeps_average(without)
    assert chosen_weights(None, "ckpt", with_average, on) == "ema"
    assert chosen_weights(None, "ckpt", with_average, off) == "raw"
    assert chosen_weights(None, "ckpt", without, None) == "raw"
    assert chosen_weights("raw", "ckpt", with_average, on) == "raw"
    assert chosen_weights("ema", "ckpt", with_average, off) == "ema"
    with pytest.raises(
        CheckpointError, match=r"--weights ema: checkpoint ckpt holds no weight average .* --weights raw"
    ):
        chosen_weights("ema", "ckpt", without, None)
    with pytest.raises(UserError, match="--weights must be one of ema, raw, got 'best'"):
        check_weights("best")
