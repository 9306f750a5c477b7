"""Expert parallelism on the CPU's 8 devices: Mixtral nano at expert 4 x data 2 trains like one device (losses,
grad norms, parameters), its compiled step sends tokens by all-to-all, a checkpoint moves to data 8, and a rerun is
bitwise; Qwen3-MoE and gpt-oss give one device's loss with their experts split."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

import dist_ckpt
import named_tensors as nt
from lm_models import next_token_loss
from lm_train.config import load_train_config
from lm_train.optim import build_optimizer
from lm_train.run.checkpoints import restore_state
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_model, init_state, state_shapes, trainable
from lm_train.run.step import StepSettings, make_train_step

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
Vocab = nt.Axis("vocab", 96)
BATCH, SEQ, STEPS = 16, 32, 5
# Mixtral nano's layout (4 experts, top 2, router losses) at a size that compiles quickly on 2 busy cores.
SMALL = ["--model.hidden_dim", "64", "--model.intermediate_dim", "48", "--model.num_layers", "2"]
SMALL += ["--model.seq_len", str(SEQ), "--model.num_heads", "4", "--model.num_kv_heads", "2"]
SMALL += ["--trainer.train_batch_size", str(BATCH), "--trainer.num_train_steps", "10", "--optimizer.warmup", "0"]


def _batches(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, Vocab.size, size=(BATCH, SEQ), dtype=np.int32) for _ in range(n)]


class Run:
    """One layout of the tiny Mixtral: its plan, its compiled step and a fresh state."""

    def __init__(self, devices: int, *overrides: str):
        self.config, _ = load_train_config([CONFIGS / "mixtral_nano.yaml"], [*SMALL, *overrides])
        self.plan = plan_mesh(self.config.trainer, devices=jax.devices()[:devices])
        self.optimizer, schedule = build_optimizer(self.config.optimizer, self.config.trainer.num_train_steps)
        self.shapes = state_shapes(self.config, self.plan, Vocab, self.optimizer)
        settings = StepSettings(parse_policy(self.config.trainer.mp), 1, 0.0)
        step_fn = make_train_step(self.optimizer, settings, schedule)
        self.step = CompiledStep(step_fn, StateLayout(self.shapes), self.plan, self.config.model.Pos, "batch")

    def fresh(self):
        return init_state(self.config, self.plan, Vocab, self.optimizer)

    def train(self, state, batches) -> tuple[object, list[float], list[float]]:
        losses, norms = [], []
        for batch in batches:
            state, metrics = self.step(state, batch)
            losses.append(float(metrics["train/loss"]))
            norms.append(float(metrics["optim/grad_norm"]))
        return state, losses, norms


def _params(state) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(trainable(state.model))]


@pytest.fixture(scope="module")
def mixtral_runs(tmp_path_factory):
    """Five steps on one device, at expert 4 x data 2 (twice), and the sixth from its checkpoint at data 8."""
    batches = _batches(STEPS + 1)
    one = Run(1)
    one_state, one_losses, one_norms = one.train(one.fresh(), batches[:STEPS])
    ep = Run(8, "--trainer.expert_axis_size", "4")
    state = ep.fresh()
    hlo = ep.step.precompile(state, BATCH).as_text()
    state, ep_losses, ep_norms = ep.train(state, batches[:STEPS])
    ep_params = _params(state)
    checkpoint = tmp_path_factory.mktemp("expert-parallel") / "step-5"
    dist_ckpt.save(state, checkpoint, step=STEPS, block=True, progress=False)
    state, next_losses, _ = ep.train(state, batches[STEPS:])
    next_params = _params(state)
    rerun, rerun_losses, rerun_norms = ep.train(ep.fresh(), batches[:STEPS])
    dp = Run(8)
    resumed = restore_state(checkpoint, dp.shapes)
    resumed, dp_losses, _ = dp.train(resumed, batches[STEPS:])
    return {
        "ep": ep, "dp": dp, "hlo": hlo,
        "one": (one_losses, one_norms, _params(one_state)),
        "expert": (ep_losses, ep_norms, ep_params),
        "rerun": (rerun_losses, rerun_norms, _params(rerun)),
        "next": (next_losses, next_params), "resumed": (dp_losses, _params(resumed)),
    }  # fmt: skip


def test_expert_4_x_data_2_trains_like_one_device(mixtral_runs):
    ep = mixtral_runs["ep"]
    assert dict(ep.plan.mesh.shape) == {"replica": 1, "stage": 1, "data": 2, "context": 1, "expert": 4, "model": 1}
    expert_weights = [
        leaf
        for leaf in jax.tree.leaves(ep.shapes.model, is_leaf=nt.is_named)
        if nt.is_named(leaf) and "experts" in leaf.axis_names and "mlp" in leaf.axis_names
    ]
    assert len(expert_weights) == 3  # gate, up and down, stacked over the layers
    for w in expert_weights:  # one expert per device
        assert w.array.sharding.spec[w.axis_names.index("experts")] == "expert"
    (one_losses, one_norms, one_params), (losses, norms, params) = mixtral_runs["one"], mixtral_runs["expert"]
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, one_norms, rtol=1e-5)
    assert one_losses[-1] < one_losses[0]  # it trained
    for p, ref in zip(params, one_params, strict=True):
        np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-5)


def test_the_compiled_step_sends_tokens_by_all_to_all(mixtral_runs):
    hlo = mixtral_runs["hlo"]
    # Forward there and back and their transposes, in each of the 2 layers.
    assert hlo.count(" all-to-all(") >= 8, hlo.count(" all-to-all(")


def test_a_checkpoint_from_expert_4_resumes_at_data_8_and_a_rerun_is_bitwise(mixtral_runs):
    (next_losses, next_params), (dp_losses, dp_params) = mixtral_runs["next"], mixtral_runs["resumed"]
    np.testing.assert_allclose(dp_losses, next_losses, rtol=1e-5)
    for p, ref in zip(dp_params, next_params, strict=True):
        np.testing.assert_allclose(p, ref, rtol=1e-5, atol=1e-5)
    (losses, norms, params), (again, again_norms, again_params) = mixtral_runs["expert"], mixtral_runs["rerun"]
    assert again == losses and again_norms == norms
    for p, ref in zip(again_params, params, strict=True):
        np.testing.assert_array_equal(p, ref)


@pytest.mark.parametrize(
    ("family", "expert_axis"),
    [("qwen3_moe", "2"), ("gpt_oss", "4")],  # 6 experts over 2 devices (top 3); 4 over 4, with biases
)
def test_other_moe_families_give_one_devices_loss_with_their_experts_split(family, expert_axis):
    shapes = ["--model.hidden_dim", "64", "--model.num_layers", "2", "--model.seq_len", str(SEQ)]
    config, _ = load_train_config([CONFIGS / f"{family}_nano.yaml"], shapes)
    ids = nt.named(_batches(1, seed=3)[0], ("batch", "position"))
    one = plan_mesh(config.trainer, devices=jax.devices()[:1])
    model = init_model(config, one, Vocab)
    loss = jax.jit(lambda m, b: next_token_loss(m, b).array)
    with nt.axis_mapping(one.compute_mapping, mesh=one.mesh):
        expected = float(loss(model, ids))
    plan = plan_mesh(dataclasses.replace(config.trainer, expert_axis_size=int(expert_axis)))
    assert plan.compute_mapping["experts"] == "expert"
    with nt.axis_mapping(plan.param_mapping, mesh=plan.mesh):
        split = nt.shard_tree(model)  # the same weights, each device holding its experts
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        np.testing.assert_allclose(float(loss(split, nt.shard_tree(ids))), expected, rtol=1e-5)
