"""DeepSeek-V3's aux-loss-free balancing in the real train step: it evens out the experts' load from a skewed start,
resumes bitwise, and switched off leaves the correction biases alone and logs no bias."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import dist_ckpt
import named_tensors as nt
from lm_train.config import load_train_config
from lm_train.optim import build_optimizer
from lm_train.run.checkpoints import restore_state
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state, state_shapes
from lm_train.run.step import StepSettings, make_train_step

CONFIG = Path(__file__).parents[3] / "configs" / "deepseek_v3_nano.yaml"
Vocab = nt.Axis("vocab", 64)
TINY = ["--model.hidden_dim", "32", "--model.intermediate_dim", "48", "--model.num_layers", "1"]
TINY += ["--model.num_heads", "2", "--model.q_lora_rank", "8", "--model.kv_lora_rank", "8", "--model.seq_len", "16"]
TINY += ["--model.qk_nope_head_dim", "8", "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8"]
TINY += ["--model.moe_intermediate_dim", "8", "--model.num_experts_per_tok", "2", "--model.lbl_coef", "0"]
TINY += ["--model.first_k_dense_replace", "0"]
TINY += ["--trainer.train_batch_size", "8", "--trainer.num_train_steps", "8", "--optimizer.warmup", "0"]
RATE = 0.05
# As an imported checkpoint may bring it: the correction bias favours the first experts (6 experts, 3 groups).
SKEW = np.linspace(0.3, -0.3, 6, dtype=np.float32)


def _ids(step: int) -> np.ndarray:
    return np.random.default_rng(step).integers(0, Vocab.size, size=(8, 16), dtype=np.int32)


def _bias(state) -> np.ndarray:
    (bias,) = state.model.routing_biases()  # the one layer's, (layers, experts) or (experts,)
    return np.asarray(bias.array).reshape(-1)


def _run(speed: float):
    """The compiled step (as the loop runs it), its state with the skewed bias, and the shapes to restore onto."""
    config, _ = load_train_config([CONFIG], [*TINY, "--model.bias_update_speed", str(speed)])
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0, config.trainer.batch_axis)
    target = state_shapes(config, plan, Vocab, optimizer)
    run = CompiledStep(
        make_train_step(optimizer, settings, schedule), StateLayout(target), plan, config.model.Pos, "batch"
    )
    state = init_state(config, plan, Vocab, optimizer)
    where = lambda s: s.model.routing_biases()[0].array  # noqa: E731
    state = eqx.tree_at(
        where, state, jax.device_put(jnp.array(SKEW).reshape(where(state).shape), where(state).sharding)
    )  # donated: a copy
    return run, state, target


def test_balancing_evens_the_load_resumes_bitwise_and_costs_nothing_when_off(tmp_path):
    run, state, target = _run(RATE)
    on = []
    for step in range(4):
        before = _bias(state)
        state, metrics = run(state, _ids(step))
        on.append({k: float(v) for k, v in metrics.items() if k.startswith("router/") and k != "router/load_hist"})
        moved = (_bias(state) - before) / RATE  # outside the gradient: exactly one step of RATE up, down or none
        np.testing.assert_allclose(moved, np.round(moved), atol=1e-4)
        assert set(np.round(moved).astype(int).tolist()) <= {-1, 0, 1} and np.abs(moved).max() > 0.5
    assert on[-1]["router/balance_bias_max"] == float(_bias(state).max())
    dist_ckpt.save(state.checkpointed(), tmp_path / "step-4", step=4, block=True, progress=False)
    straight = state
    for step in range(4, 8):
        straight, metrics = run(straight, _ids(step))
    on_cv = float(metrics["router/load_cv"])
    # The favoured first experts were pushed down, the neglected last ones up.
    assert _bias(straight)[0] < SKEW[0] and _bias(straight)[-1] > SKEW[-1]

    resumed = restore_state(tmp_path / "step-4", target)
    for step in range(4, 8):
        resumed, _ = run(resumed, _ids(step))
    for a, b in zip(jax.tree.leaves(straight.checkpointed()), jax.tree.leaves(resumed.checkpointed()), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    # Off (the same seed and batches): the bias stays the skewed start, bit for bit, and no bias is logged.
    run_off, off, _ = _run(0.0)
    for step in range(8):
        off, off_metrics = run_off(off, _ids(step))
    assert np.array_equal(_bias(off), SKEW)
    assert not any(k.startswith("router/balance_bias") for k in off_metrics)
    off_cv = float(off_metrics["router/load_cv"])
    assert on_cv < 0.7 * off_cv, (on_cv, off_cv)
