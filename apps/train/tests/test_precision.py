"""Precision policies from strings, and the dynamic loss scale against the rules written out by hand."""

import jax
import jax.numpy as jnp
import pytest

from lm_train.errors import ConfigError
from lm_train.run.precision import LossScale, all_finite, needs_loss_scaling, parse_policy


@pytest.mark.parametrize(
    ("text", "param", "compute"),
    [
        ("f32", jnp.float32, jnp.float32),
        ("p=f32,c=bfloat16", jnp.float32, jnp.bfloat16),
        ("bfloat16", jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_policies(text, param, compute):
    policy = parse_policy(text)
    assert policy.param_dtype == param and policy.compute_dtype == compute


def test_auto_is_f32_on_cpu_and_bf16_compute_on_accelerators():
    from lm_train.config import TrainerConfig, TrainLmConfig
    from lm_train.run.precision import resolve_mp, with_resolved_mp

    assert resolve_mp("auto", "cpu") == "f32" and resolve_mp("auto") == "f32"  # the tests' devices are CPUs
    assert resolve_mp("auto", "gpu") == resolve_mp("auto", "tpu") == "p=f32,c=bfloat16"
    assert resolve_mp("bfloat16", "cpu") == "bfloat16"  # a policy given is kept
    assert parse_policy("auto", "gpu").compute_dtype == jnp.bfloat16
    config = TrainLmConfig(trainer=TrainerConfig())
    assert config.trainer.mp == "auto" and with_resolved_mp(config, "gpu").trainer.mp == "p=f32,c=bfloat16"
    resolved = with_resolved_mp(config)  # what a run records in its config.yaml
    assert resolved.trainer.mp == "f32" and with_resolved_mp(resolved) is resolved


def test_fp16_needs_scaling_and_bf16_does_not():
    assert needs_loss_scaling(parse_policy("p=f32,c=float16"))
    assert not needs_loss_scaling(parse_policy("p=f32,c=bfloat16"))


def test_bad_policy_names_the_key():
    with pytest.raises(ConfigError, match=r"trainer.mp: cannot read precision policy 'p=f33'"):
        parse_policy("p=f33")


def test_overflow_halves_scale_and_resets_counter():
    scale = LossScale.create(True, initial=1024.0, period=3)
    scale = scale.adjust(jnp.asarray(True)).adjust(jnp.asarray(True))
    assert int(scale.counter) == 2 and float(scale.scale) == 1024.0
    scale = scale.adjust(jnp.asarray(False))
    assert float(scale.scale) == 512.0 and int(scale.counter) == 0


def test_growth_after_period_and_floor_at_min():
    scale = LossScale.create(True, initial=4.0, period=2)
    scale = scale.adjust(jnp.asarray(True)).adjust(jnp.asarray(True))
    assert float(scale.scale) == 8.0 and int(scale.counter) == 0
    low = LossScale(jnp.asarray(1.0, jnp.float32), jnp.zeros((), jnp.int32), True, 2, 2.0, 1.0)
    assert float(low.adjust(jnp.asarray(False)).scale) == 1.0


def test_tree_round_trip_keeps_every_setting():
    scale = LossScale(jnp.asarray(8.0, jnp.float32), jnp.asarray(1, jnp.int32), True, 7, 3.0, 0.5)
    leaves, treedef = jax.tree_util.tree_flatten(scale)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (back.period, back.factor, back.min_scale) == (7, 3.0, 0.5)
    assert float(back.adjust(jnp.asarray(False)).scale) == pytest.approx(8.0 / 3.0)


def test_scale_and_unscale_are_inverse_and_disabled_is_identity():
    scale = LossScale.create(True, initial=256.0)
    grads = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2))}
    back = scale.unscale(jax.tree_util.tree_map(lambda g: g * 256.0, grads))
    assert all(jnp.array_equal(back[k], grads[k]) for k in grads)
    off = LossScale.create(False)
    assert off.scale_loss(jnp.asarray(2.0)) == 2.0 and off.unscale(grads) is grads


def test_all_finite():
    assert bool(all_finite({"a": jnp.ones(3), "n": jnp.arange(3)}))
    assert not bool(all_finite({"a": jnp.array([1.0, jnp.inf])}))
