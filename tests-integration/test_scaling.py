"""Scaling and numerics of lm-train: FSDP + TP on 8 CPU devices against 1 device, fp16 loss scaling (an injected
overflow is skipped and training recovers), bf16 and f32 runs, the loss scale's checkpoint round trip, Sophia."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_ckpt
import named_tensors as nt
import trackers
from conftest import xla_flags

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ONE_DEVICE = {"XLA_FLAGS": xla_flags(1)}
EIGHT_DEVICES = {"XLA_FLAGS": xla_flags(8)}


def metrics(run_dir: Path, key: str = "train/loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if key in r}


def train(tiny_project, cli, name: str, *extra: str, env: dict[str, str], files: tuple[Path, ...] = ()) -> Path:
    """Train the tiny config (plus overlay files and overrides) with `lm-train run`; the run directory."""
    run_dir = tiny_project.root / "runs" / name
    args = ["run", str(tiny_project.config), *map(str, files), "--trainer.run_dir", str(run_dir)]
    result = cli([*args, "--trainer.log_every", "1", *extra], tiny_project.root, env=env)
    assert result.returncode == 0, result.output[-5000:]
    return run_dir


def assert_loss_falls(run_dir: Path) -> dict[int, float]:
    curve = metrics(run_dir)
    assert sorted(curve) == list(range(1, 13))
    assert all(np.isfinite(v) for v in curve.values())
    first, last = np.mean([curve[1], curve[2]]), np.mean([curve[11], curve[12]])
    assert last < first - 0.1, curve
    return curve


# -- FSDP + TP on 8 devices == 1 device ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device_run(tiny_project, cli):
    """The tiny config (f32) on a single CPU device: the reference curve."""
    return train(tiny_project, cli, "scaling-one-device", env=ONE_DEVICE)


def test_fsdp_plus_tensor_parallel_matches_one_device(tiny_project, cli, one_device_run):
    sharded = train(tiny_project, cli, "scaling-fsdp-tp", "--trainer.model_axis_size", "2", env=EIGHT_DEVICES)
    one, many = metrics(one_device_run), metrics(sharded)
    assert sorted(one) == sorted(many) == list(range(1, 13))
    np.testing.assert_allclose([many[s] for s in sorted(many)], [one[s] for s in sorted(one)], rtol=0, atol=1e-5)
    # The run recorded its 4 (data) x 2 (model) mesh setting.
    assert "model_axis_size: 2" in (sharded / "config.yaml").read_text()


def test_f32_loss_falls(one_device_run):
    assert_loss_falls(one_device_run)


def test_bf16_compute_trains_and_the_loss_falls(tiny_project, cli, one_device_run):
    run_dir = train(tiny_project, cli, "scaling-bf16", "--trainer.mp", "p=f32,c=bfloat16", env=ONE_DEVICE)
    curve = assert_loss_falls(run_dir)
    f32 = metrics(one_device_run)
    # Same data and init, lower-precision compute: close to the f32 curve, but not the same numbers.
    assert max(abs(curve[s] - f32[s]) for s in curve) < 0.25
    assert curve != f32
    assert "optim/loss_scale" not in trackers.read_jsonl(run_dir / "metrics.jsonl")[0]


# -- fp16 with dynamic loss scaling -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_run(tiny_project, cli):
    return train(tiny_project, cli, "scaling-fp16", "--trainer.mp", "p=f32,c=float16", env=ONE_DEVICE)


def test_fp16_run_trains_with_a_loss_scale(fp16_run):
    assert_loss_falls(fp16_run)
    scales = metrics(fp16_run, "optim/loss_scale")
    assert set(scales.values()) == {2.0**15}  # no overflow in 12 steps; the scale grows only every 2000
    assert all(metrics(fp16_run, "optim/grads_finite").values())


def test_fp16_checkpoint_restores_the_whole_loss_scale(tiny_project, fp16_run):
    from lm_train.config import load_train_config
    from lm_train.optim import build_optimizer
    from lm_train.run.checkpoints import restore_state
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.precision import LossScale
    from lm_train.run.state import state_shapes
    from shard_cache import load_tokenizer

    flat = dist_ckpt.load(fp16_run / "checkpoints" / "step-12", progress=False)
    scale_keys = sorted(k for k in flat if "loss_scale" in k)
    assert scale_keys, sorted(flat)[:20]
    config, _ = load_train_config([fp16_run / "config.yaml"])
    assert config.trainer.mp == "p=f32,c=float16"
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    Vocab = nt.Axis("vocab", load_tokenizer(str(fp16_run / "tokenizer.json")).get_vocab_size(with_added_tokens=True))
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = restore_state(fp16_run / "checkpoints" / "step-12", state_shapes(config, plan, Vocab, optimizer))
    fresh = LossScale.create(True)
    assert int(state.step) == 12
    assert float(state.loss_scale.scale) == 2.0**15 and int(state.loss_scale.counter) == 12
    assert (state.loss_scale.enabled, state.loss_scale.period, state.loss_scale.factor, state.loss_scale.min_scale) == (
        fresh.enabled,
        fresh.period,
        fresh.factor,
        fresh.min_scale,
    )


def test_loss_scale_round_trips_through_dist_ckpt_with_all_its_settings(tmp_path):
    """jmp 0.0.4's DynamicLossScale loses min_loss_scale in a tree round trip; our LossScale keeps everything."""
    from lm_train.run.precision import LossScale

    scale = LossScale(jnp.asarray(1024.0, jnp.float32), jnp.asarray(7, jnp.int32), True, 50, 4.0, 256.0)
    # A plain pytree round trip keeps the settings (they live in the tree structure, not in the leaves)...
    leaves, treedef = jax.tree_util.tree_flatten(scale)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (again.period, again.factor, again.min_scale, again.enabled) == (50, 4.0, 256.0, True)
    # ... and so does a checkpoint, saved and loaded onto the abstract structure of the same state.
    dist_ckpt.save({"loss_scale": scale}, tmp_path / "ckpt", step=7, block=True, progress=False)
    target = eqx.filter_eval_shape(lambda: {"loss_scale": scale})
    restored = dist_ckpt.load(tmp_path / "ckpt", target, progress=False)["loss_scale"]
    assert isinstance(restored, LossScale)
    assert float(restored.scale) == 1024.0 and int(restored.counter) == 7
    assert (restored.period, restored.factor, restored.min_scale, restored.enabled) == (50, 4.0, 256.0, True)
    # The restored minimum is in force: repeated overflows stop at 256, not at jmp's default of 1.
    for _ in range(5):
        restored = restored.adjust(jnp.asarray(False))
    assert float(restored.scale) == 256.0 and int(restored.counter) == 0
    # Growth uses the restored period and factor: 50 finite steps after a reset multiply the scale by 4.
    for _ in range(50):
        restored = restored.adjust(jnp.asarray(True))
    assert float(restored.scale) == 1024.0


def test_fp16_injected_overflow_is_skipped_and_training_recovers(tiny_project, monkeypatch):
    """In process, from lm_train's own pieces: a poisoned batch makes the fp16 gradients overflow once."""
    import lm_train.run.objectives as objective_module
    from lm_train.config import load_train_config
    from lm_train.optim import build_optimizer
    from lm_train.run.compiled import CompiledStep, StateLayout
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.precision import parse_policy
    from lm_train.run.state import init_state, state_shapes, trainable
    from lm_train.run.step import StepSettings, make_train_step

    real_loss = objective_module.next_token_loss

    def loss_that_overflows_on_a_constant_batch(model, input_ids, **kwargs):
        # The test's injection: a batch of one repeated token multiplies the loss by 1e8, so that the fp16
        # backward pass overflows; every other batch gets exactly its own loss (times 1.0).
        loss = real_loss(model, input_ids, **kwargs)
        loss = (loss.array if isinstance(loss, nt.NamedArray) else loss).astype(jnp.float32)
        ids = input_ids.array
        poisoned = jnp.all(ids == ids.reshape(-1)[0])
        return loss * jnp.where(poisoned, jnp.float32(1e8), jnp.float32(1.0))

    monkeypatch.setattr(objective_module, "next_token_loss", loss_that_overflows_on_a_constant_batch)

    config, _ = load_train_config([tiny_project.config], ["--trainer.mp", "p=f32,c=float16"])
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    Vocab = nt.Axis("vocab", 64)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    target = state_shapes(config, plan, Vocab, optimizer)
    policy = parse_policy(config.trainer.mp)
    settings = StepSettings(policy, 1, 0.0, config.trainer.batch_axis)
    train_step = CompiledStep(
        make_train_step(optimizer, settings, schedule), StateLayout(target), plan, config.model.Pos, "batch"
    )
    state = init_state(config, plan, Vocab, optimizer)
    assert state.loss_scale.enabled and float(state.loss_scale.scale) == 2.0**15

    rng = np.random.default_rng(0)
    # A learnable stream (token t+1 = token t + 1 mod 64) so that the loss can fall.
    starts = rng.integers(0, 64, size=(8, 1))
    good = ((starts + np.arange(32)) % 64).astype(np.int32)
    poisoned = np.full((8, 32), 5, np.int32)

    def snapshot(s):
        return jax.device_get((trainable(s.model), s.opt_state))

    def same(a, b) -> bool:
        la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
        if len(la) != len(lb):
            return False
        return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True))

    losses = []
    for _ in range(3):
        state, m = train_step(state, good)
        assert bool(m["optim/grads_finite"])
        losses.append(float(m["train/loss"]))
    before_step, before_scale = int(state.step), float(state.loss_scale.scale)
    before = snapshot(state)

    state, m = train_step(state, poisoned)
    assert not bool(m["optim/grads_finite"])
    assert int(state.step) == before_step + 1  # the step counts (the data and schedule move on)...
    assert same(snapshot(state), before)  # ...but parameters and optimizer state are untouched
    assert float(state.loss_scale.scale) == before_scale / 2 and int(state.loss_scale.counter) == 0

    for _ in range(4):
        state, m = train_step(state, good)
        assert bool(m["optim/grads_finite"])
        losses.append(float(m["train/loss"]))
    assert not same(snapshot(state), before)  # training goes on from where it was
    assert float(state.loss_scale.scale) == before_scale / 2 and int(state.loss_scale.counter) == 4
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


# -- Sophia -------------------------------------------------------------------------------------------------


def sophia_overlay(tiny_project, kind: str) -> Path:
    """The repository's configs/gpt2_nano_sophia.yaml; for Sophia-H edited as its comment says (type, gamma)."""
    text = (REPO / "configs" / "gpt2_nano_sophia.yaml").read_text(encoding="utf-8")
    assert "type: sophia-g" in text and "gamma: 0.05" in text
    if kind == "sophia-h":
        text = text.replace("type: sophia-g", "type: sophia-h").replace("gamma: 0.05", "gamma: 0.01")
    return tiny_project.write_config(f"{kind}.yaml", text)


# Sophia-G runs sharded (FSDP over 8 devices), Sophia-H on one device: both layouts, and less CI time.
@pytest.mark.parametrize(("kind", "env"), [("sophia-g", EIGHT_DEVICES), ("sophia-h", ONE_DEVICE)])
def test_sophia_trains_and_the_loss_falls(tiny_project, cli, kind, env):
    run_dir = train(tiny_project, cli, f"scaling-{kind}", env=env, files=(sophia_overlay(tiny_project, kind),))
    assert_loss_falls(run_dir)
    rows = trackers.read_jsonl(run_dir / "metrics.jsonl")
    fractions = [r["optim/sophia_unclipped_fraction"] for r in rows if "optim/sophia_unclipped_fraction" in r]
    assert len(fractions) == 12 and all(0.0 <= f <= 1.0 for f in fractions)
    resolved = (run_dir / "config.yaml").read_text()
    assert f"type: {kind}" in resolved and "learning_rate: 0.002" in resolved
