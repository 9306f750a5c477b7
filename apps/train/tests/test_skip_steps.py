"""optimizer.skip_bad_steps: the window's decision against numpy, and a run that skips exactly its bad steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from lm_train.config.optimizer_config import SkipStepConfig
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer
from lm_train.optim.skip_steps import init_window, judge_step
from lm_train.run.batch import TokenBatch
from lm_train.run.mesh import plan_mesh
from lm_train.run.objectives import next_token_objective
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state
from lm_train.run.step import StepSettings, make_train_step

VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)
SPIKE, POISON = 62, 63  # a batch whose first token is one of these blows its loss up (x 1e6) or makes it NaN


def _reference_decisions(norms, length, sigma_factor):
    """Take or skip each norm, from numpy's median of the last `length` finite norms (1.4826 * MAD as sigma)."""
    history, out = [], []
    for norm in norms:
        window = history[-length:]
        take = bool(np.isfinite(norm))
        if take and len(window) >= max(2, length // 2):
            median = np.median(window)
            sigma = max(1.4826 * np.median(np.abs(np.asarray(window) - median)), 1e-6)
            take = norm <= median + sigma_factor * sigma
        out.append(take)
        if np.isfinite(norm):
            history.append(norm)
    return out


def test_the_window_decides_as_a_numpy_median_and_mad():
    rng = np.random.default_rng(0)
    norms = list(1.0 + 0.1 * rng.standard_normal(40))
    norms[7], norms[15], norms[16], norms[30] = 50.0, np.nan, np.inf, 1.9  # spikes, non-finite, a mild outlier
    config = SkipStepConfig(rolling_interval_length=8, sigma_factor=6.0)
    window, got = init_window(config), []
    judge = jax.jit(lambda w, n: judge_step(w, n, jnp.float32(1.0), config))
    for norm in norms:
        take, window, metrics = judge(window, jnp.float32(norm))
        got.append(bool(take))
        assert float(metrics["optim/skipped_step"]) == float(not take)
    want = _reference_decisions(np.float32(norms), 8, 6.0)
    assert got == want
    assert not got[7] and not got[15] and not got[16] and not got[30] and sum(got) == 36
    assert int(window.skipped) == 4 and int(window.count) == 8
    # A non-finite loss is skipped whatever the norm.
    take, _, _ = judge_step(window, jnp.float32(1.0), jnp.float32(np.nan), config)
    assert not bool(take)


def _batch(first_token: int, seed: int) -> TokenBatch:
    ids = np.random.default_rng(seed).integers(0, SPIKE, size=(8, 16), dtype=np.int32)
    ids[0, 0] = first_token
    return TokenBatch(nt.named(jnp.asarray(ids), ("batch", "position")))


def _crafted_objective():
    lm = next_token_objective()

    def objective(model, batch, key, frozen, kind_state):
        loss, extra, kind_state = lm(model, batch, key, frozen, kind_state)
        first = batch.input_ids.array[0, 0]
        scale = jnp.where(first == SPIKE, 1e6, jnp.where(first == POISON, jnp.nan, 1.0))
        return loss * scale, extra, kind_state

    return objective


def _leaves(tree):
    return [np.asarray(x.array if isinstance(x, nt.NamedArray) else x) for x in jax.tree_util.tree_leaves(tree)]


def _bitwise_equal(a, b) -> bool:
    return all(x.tobytes() == y.tobytes() for x, y in zip(_leaves(a), _leaves(b), strict=True))


def test_a_run_skips_exactly_the_blown_up_and_the_nan_step(make_config):
    config = make_config("--optimizer.skip_bad_steps", "{rolling_interval_length: 4, sigma_factor: 6.0}")
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0, skip_steps=config.optimizer.skip_steps)
    step = jax.jit(make_train_step(optimizer, settings, schedule, objective=_crafted_objective()))
    firsts = [0, 1, 2, SPIKE, POISON, 3]
    skipped = []
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        for i, first in enumerate(firsts):
            before = state
            state, metrics = step(state, _batch(first, i))
            skipped.append(float(metrics["optim/skipped_step"]))
            if first in (SPIKE, POISON):
                assert _bitwise_equal(state.model, before.model) and _bitwise_equal(state.opt_state, before.opt_state)
            else:
                assert not _bitwise_equal(state.model, before.model)
    assert skipped == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert int(metrics["optim/skipped_steps"]) == 2 and int(state.step) == 6
    assert int(state.skip_window.count) == 4  # the spike's norm entered the window, the NaN's did not


def test_off_the_state_keeps_no_window(make_config):
    config = make_config()
    assert config.optimizer.skip_steps is None and config.optimizer.skip_bad_steps is False
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    assert init_state(config, plan, Vocab, optimizer).skip_window is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", SkipStepConfig()), ("64", SkipStepConfig(rolling_interval_length=64)), ("false", None)],
)
def test_levanter_shapes_of_the_key(make_config, value, expected):
    assert make_config("--optimizer.skip_bad_steps", value).optimizer.skip_steps == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{rolling_interval_length: 1}", r"optimizer.skip_bad_steps.rolling_interval_length must be at least 2"),
        ("{sigma_factor: -1}", r"optimizer.skip_bad_steps.sigma_factor must be >= 0"),
        ("{window: 8}", r"unknown key `optimizer.skip_bad_steps.window`"),
    ],
)
def test_bad_skip_bad_steps_values_name_the_key(make_config, value, message):
    with pytest.raises(ConfigError, match=message):
        make_config("--optimizer.skip_bad_steps", value)
