"""Learning-rate schedules against their formulas, the weight-decay mask, and clipping."""

import itertools
import math

import jax.numpy as jnp
import numpy as np
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


def _reference_lr(t, *, lr, min_ratio, shape, total, warmup, decay=None, rewarmup=0.0, ends=()):
    """The schedule at step t, written out from Levanter's description: cycles of warm-up, stable, decay."""
    points = [0, *ends, total] if not ends or ends[-1] != total else [0, *ends]
    floor = lr * min_ratio

    def steps(value, length):
        return int(value * length) if value < 1 else int(value)

    def decayed(shape, k, n, w):
        if shape == "constant" or n == 0:
            return lr
        if shape == "linear":
            return lr + (floor - lr) * min(k, n) / n
        if shape == "cosine":
            return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(k, n) / n))
        if shape == "inv_sqrt":
            return max(lr * min(1.0, 1.0 / math.sqrt(max(k + w, 1) / 10000.0)), floor)
        return max(lr * min(1.0, 1.0 / ((lr / floor - 1) * max(k, 1) / n + 1)), floor)

    start_lr = 0.0
    for cycle, (a, b) in enumerate(itertools.pairwise(points)):
        n = b - a
        w = steps(warmup if cycle == 0 else rewarmup, n)
        d = steps(decay, n) if decay is not None else n - w
        s = n - w - d
        if t < b or b == total:
            k = t - a
            if k < w:
                return start_lr + (lr - start_lr) * k / w
            if k < w + s:
                return lr
            return decayed(shape, k - w - s, d, w)
        start_lr = decayed(shape, d, d, w)
    raise AssertionError


@pytest.mark.parametrize("shape", ["cosine", "linear", "constant", "inv_sqrt", "inv"])
@pytest.mark.parametrize(
    "keys",
    [
        {"warmup": 10, "decay": 0.2},  # WSD: warm-up, hold, decay over the last 20% (Levanter's meaning)
        {"warmup": 0.05, "decay": 30},
        {"warmup": 0.0, "decay": None},
        {"warmup": 8, "decay": 0.25, "rewarmup": 0.1, "cycles": 3},
        {"warmup": 5, "decay": 10, "rewarmup": 4, "cycles": (40, 70)},
        {"warmup": 5, "decay": 0.5, "cycle_length": 0.25},
        {"warmup": 5, "decay": 10, "cycle_length": (30, 30)},
    ],
)
def test_every_schedule_matches_a_plain_python_reference_at_every_step(shape, keys):
    total, lr, ratio = 120, 3e-3, 0.1
    cfg = AdamConfig(learning_rate=lr, min_lr_ratio=ratio, lr_schedule=shape, **keys)
    sched = learning_rate_schedule(cfg, total)
    if "cycles" in keys and isinstance(keys["cycles"], int):
        ends = [int(total / keys["cycles"] * (i + 1)) for i in range(keys["cycles"] - 1)]
    elif "cycles" in keys:
        ends = list(keys["cycles"])
    elif keys.get("cycle_length") == 0.25:
        ends = [30, 60, 90]
    elif "cycle_length" in keys:
        ends = [30, 60]
    else:
        ends = []
    ref = {k: keys.get(k, d) for k, d in (("warmup", 0.01), ("decay", None), ("rewarmup", 0.0))}
    got = np.asarray([sched(t) for t in range(total)], np.float64)
    want = np.asarray(
        [_reference_lr(t, lr=lr, min_ratio=ratio, shape=shape, total=total, ends=ends, **ref) for t in range(total)]
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)


def test_wsd_holds_the_peak_then_decays_over_the_end():
    """`decay` is the length of the final decay, not the time from warm-up to the floor (the old meaning)."""
    sched = learning_rate_schedule(
        AdamConfig(learning_rate=1.0, warmup=10, decay=20, min_lr_ratio=0.0, lr_schedule="linear"), 100
    )
    assert [float(sched(t)) for t in (10, 50, 79, 80)] == [1.0, 1.0, 1.0, 1.0]
    assert float(sched(90)) == pytest.approx(0.5) and float(sched(99)) == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"warmup": 60, "decay": 50}, r"optimizer.warmup/rewarmup \(60 steps\) and optimizer.decay \(50 steps\)"),
        ({"cycles": (50, 40)}, r"optimizer.cycles gives cycles ending at steps \[50, 40, 100\]"),
        ({"cycles": 2, "cycle_length": 10}, r"optimizer.cycles and optimizer.cycle_length are both given"),
        ({"decay": -3}, r"optimizer.decay must be a fraction"),
        ({"lr_schedule": "inv", "min_lr_ratio": 0.0}, r"optimizer.lr_schedule inv .* positive min_lr_ratio"),
    ],
)
def test_bad_schedule_keys_are_config_errors_that_name_the_key(keys, message):
    with pytest.raises(ConfigError, match=message):
        learning_rate_schedule(AdamConfig(**{"warmup": 0, **keys}), 100)
