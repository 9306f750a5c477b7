"""Muon, MARS, SOAP, Kron in the train step: equal on 1 and 8 devices, a falling loss, bitwise resume."""

from __future__ import annotations

import re
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from optim_reference import random_grads, small_params

import dist_ckpt
import named_tensors as nt
from lm_train.config import TrainerConfig, load_train_config
from lm_train.optim import build_optimizer
from lm_train.run.checkpoints import restore_state
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state, state_shapes
from lm_train.run.step import StepSettings, make_train_step

VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)
NO_DROPOUT = ("--model.embed_pdrop", "0", "--model.resid_pdrop", "0", "--model.attn_pdrop", "0")
OPTIMIZERS = {
    "muon": ("--optimizer.type", "muon", "--optimizer.learning_rate", "0.02", "--optimizer.adam_lr", "0.006"),
    "mars": ("--optimizer.type", "mars", "--optimizer.learning_rate", "0.006"),
    "soap": (
        "--optimizer.type",
        "soap",
        "--optimizer.learning_rate",
        "0.006",
        "--optimizer.precondition_frequency",
        "2",
    ),
    # The factors update at steps 1 and 2, then every other step (the resume at 3 lands between two); each embed of
    # 32 is cut into two blocks of 16. P starts at 100 I (init scale 10), not I: at this model's gradient scale, P = I
    # would make the first steps plain momentum SGD, too short to move the loss in 6 steps.
    "kron": (
        "--optimizer.type",
        "kron",
        "--optimizer.learning_rate",
        "0.006",
        "--optimizer.preconditioner_init_scale",
        "10",
        "--optimizer.update_prob_flat_start",
        "2",
        "--optimizer.merge_small_dims",
        "false",
        "--optimizer.block_size",
        "16",
    ),
}


ONE_DEVICE = ("kron",)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# SOAP factors each of a parameter's own axes (no merging), so that its Gram matrices contract sharded axes. Kron's
# triangular factors only on the 2-wide axes (heads, sharded over `model`), the rest diagonal: all triangular, its
# compile on the two meshes cost ~15 s of CPU, over CI's budget; ~7 s so.
MESH_EQUALITY = {
    "soap": ("--optimizer.merge_small_dims", "false"),
    "kron": ("--optimizer.max_size_triangular", "2"),
}


@pytest.mark.parametrize("name", ["muon", "mars", "soap", "kron"])
def test_update_is_equal_on_one_and_eight_devices(name, make_config):
    """The same gradients give the same two updates with the params on 1 device and under FSDP x tensor parallel."""
    config = make_config(*OPTIMIZERS[name], *MESH_EQUALITY.get(name, ()), "--optimizer.weight_decay", "0.1")
    optimizer, _ = build_optimizer(config.optimizer, 10)
    params = small_params(0)
    grads = random_grads(params, np.random.default_rng(1))

    def two_steps(params, grads):
        state = optimizer.init(params)
        first, state = optimizer.update(grads, state, params)
        second, _ = optimizer.update(jax.tree.map(lambda g: -0.5 * g, grads), state, params)
        return first, second

    results = []
    for devices, model_axis_size in ((jax.devices()[:1], 1), (jax.devices(), 2)):
        plan = plan_mesh(TrainerConfig(model_axis_size=model_axis_size), devices=devices)
        placed = nt.shard_tree((params, grads), plan.param_mapping, plan.mesh)
        with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh), jax.numpy_dtype_promotion("standard"):
            results.append(_leaves(jax.jit(two_steps)(*placed)))
    # The 8-device run really was sharded: FSDP over embed, tensor parallel over heads and mlp.
    assert len({s.device for s in placed[0]["q"].weight.array.addressable_shards}) == 8
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(8, 16), dtype=np.int32)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_tiny_run_learns_and_resumes_bitwise(name, make_config, tmp_path):
    """6 steps straight, and 3 steps + save + restore onto a fresh template + 3 steps, on 8 devices (FSDP; Kron 1):
    the same bits in params and optimizer state; and the loss falls."""
    config = make_config(*OPTIMIZERS[name], *NO_DROPOUT, "--trainer.num_train_steps", "6")
    # SOAP runs on 8: its step deadlocked there in LAPACK (lm_train.optim.cpu_lapack). Kron's compiles too slowly
    # there for CI's budget (~40 s of CPU on 8 devices).
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1] if name in ONE_DEVICE else None)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0, config.trainer.batch_axis)
    target = state_shapes(config, plan, Vocab, optimizer)
    # As the loop runs it: one executable with the state's layouts fixed, the state donated.
    run = CompiledStep(
        make_train_step(optimizer, settings, schedule), StateLayout(target), plan, config.model.Pos, "batch"
    )
    state = init_state(config, plan, Vocab, optimizer)
    losses = []
    for step in range(3):
        state, metrics = run(state, _ids(step % 2))
        losses.append(float(metrics["train/loss"]))
    dist_ckpt.save(state.checkpointed(), tmp_path / "step-3", step=3, block=True, progress=False)
    straight = state
    for step in range(3, 6):
        straight, metrics = run(straight, _ids(step % 2))  # two batches, seen three times each
        losses.append(float(metrics["train/loss"]))
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses

    resumed = restore_state(tmp_path / "step-3", target)
    assert int(resumed.step) == 3
    for step in range(3, 6):
        resumed, _ = run(resumed, _ids(step % 2))
    straight_leaves, resumed_leaves = _leaves(straight.checkpointed()), _leaves(resumed.checkpointed())
    assert len(straight_leaves) == len(resumed_leaves)
    for a, b in zip(straight_leaves, resumed_leaves, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # The optimizer's own state is in the checkpoint and moved: not just zeros carried along.
    opt_leaves = _leaves(eqx.filter(resumed.opt_state, eqx.is_inexact_array))
    assert any(np.abs(x).max() > 0 for x in opt_leaves)


ROOT = Path(__file__).parents[3]


def test_every_yaml_example_of_the_optimizers_page_resolves(tmp_path):
    page = (ROOT / "docs" / "optimizers.md").read_text(encoding="utf-8")
    types = []
    for i, block in enumerate(re.findall(r"^```yaml\n(.*?)^```", page, re.MULTILINE | re.DOTALL)):
        example = tmp_path / f"example{i}.yaml"
        example.write_text(block, encoding="utf-8")
        config, _ = load_train_config([ROOT / "configs" / "gpt2_nano.yaml", example])
        types.append(type(config.optimizer).__name__)
    assert types == ["MuonConfig", "MarsConfig", "SoapConfig", "KronConfig"]
