"""Learning-rate schedules against their formulas, the weight-decay mask, and clipping."""

import math

import jax.numpy as jnp
import pytest

import named_tensors as nt
from lm_train.config import AdamConfig
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer, learning_rate_schedule, weight_decay_mask


def test_cosine_with_warmup_matches_formula():
    cfg = AdamConfig(learning_rate=1e-3, warmup=10, min_lr_ratio=0.1, lr_schedule="cosine")
    sched = learning_rate_schedule(cfg, 110)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(5e-4)
    for t in (10, 35, 60, 109):
        progress = (t - 10) / 100
        expected = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert float(sched(t)) == pytest.approx(expected, rel=1e-5)


def test_linear_decay_and_fractional_warmup():
    cfg = AdamConfig(learning_rate=2e-3, warmup=0.1, min_lr_ratio=0.0, lr_schedule="linear")
    sched = learning_rate_schedule(cfg, 100)
    assert float(sched(10)) == pytest.approx(2e-3)
    assert float(sched(55)) == pytest.approx(1e-3)
    assert float(sched(100)) == pytest.approx(0.0, abs=1e-9)


def test_default_mask_decays_matrices_only():
    E, M, V, P = nt.Axis("embed", 3), nt.Axis("mlp", 4), nt.Axis("vocab", 5), nt.Axis("position", 6)
    L = nt.Axis("layers", 2)
    params = {
        "w": nt.zeros((E, M)),
        "stacked_w": nt.zeros((L, E, M)),
        "bias": nt.zeros((M,)),
        "stacked_norm": nt.zeros((L, E)),
        "tokens": nt.zeros((V, E)),
        "positions": nt.zeros((P, E)),
    }
    assert weight_decay_mask(params) == {
        "w": True,
        "stacked_w": True,
        "bias": False,
        "stacked_norm": False,
        "tokens": False,
        "positions": False,
    }
    assert weight_decay_mask(params, ("^bias$",))["bias"] is True


def test_clipping_bounds_the_update():
    cfg = AdamConfig(learning_rate=1.0, warmup=0, weight_decay=0.0, max_grad_norm=1e-3, lr_schedule="constant")
    opt, _ = build_optimizer(cfg, 10)
    params = {"w": jnp.zeros(4)}
    import jax

    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)
        updates, _ = opt.update({"w": jnp.full(4, 1e6)}, state, params)
    # Adam normalises the (clipped) gradient: the first step moves each coordinate by about lr.
    assert jnp.allclose(updates["w"], -1.0, atol=1e-3)


def test_bad_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match=r"optimizer.lr_schedule: unknown schedule 'cosyne'"):
        AdamConfig(lr_schedule="cosyne")


def test_a_registered_optimizer_config_builds_its_own_update_rule():
    """A new optimizer is one registered config: the builder adds clipping and runs the config's own rule."""
    import dataclasses

    import jax
    import optax

    from lm_train.config.loading import decode_config
    from lm_train.config.optimizer_config import OptimizerConfig, ScheduleConfig
    from lm_train.config.schema import TrainLmConfig

    @OptimizerConfig.register_subclass("plain-sgd-for-test")
    @dataclasses.dataclass(frozen=True)
    class PlainSgd(ScheduleConfig, OptimizerConfig):
        def update_rule(self, schedule, decay_mask):
            return optax.sgd(schedule)

    try:
        raw = {"optimizer": {"type": "plain-sgd-for-test", "learning_rate": 0.5}}
        config = decode_config(TrainLmConfig, raw, {})
        assert isinstance(config.optimizer, PlainSgd)
        cfg = dataclasses.replace(config.optimizer, warmup=0, lr_schedule="constant", max_grad_norm=1.0)
        opt, _ = build_optimizer(cfg, 10)
        params = {"w": jnp.zeros(4)}
        with jax.numpy_dtype_promotion("standard"):
            updates, _ = opt.update({"w": jnp.full(4, 3.0)}, opt.init(params), params)
        # Clipped to global norm 1 (each of 4 coordinates 0.5), then plain SGD at lr 0.5: -0.25 each.
        assert jnp.allclose(updates["w"], -0.25, atol=1e-6)
    finally:
        OptimizerConfig.unregister("plain-sgd-for-test")


def test_a_registered_optimizer_without_an_update_rule_is_a_config_error():
    import dataclasses

    from lm_train.config.optimizer_config import OptimizerConfig, ScheduleConfig

    @OptimizerConfig.register_subclass("no-rule-for-test")
    @dataclasses.dataclass(frozen=True)
    class NoRule(ScheduleConfig, OptimizerConfig):
        pass

    try:
        with pytest.raises(ConfigError, match=r"without an update rule: define update_rule"):
            build_optimizer(NoRule(warmup=0, lr_schedule="constant"), 10)
    finally:
        OptimizerConfig.unregister("no-rule-for-test")
