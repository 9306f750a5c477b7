"""Context parallelism end to end, in process on the CPU's 8 devices: context 4 x data 2 against one device (five
steps of losses, gradient norms and parameters), the ring in the compiled step, and a checkpoint that resumes under
data 4 with the step the first layout would have taken, and bitwise under its own layout."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

import dist_ckpt
import named_tensors as nt

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (CPU runs force 8)")

STEPS = 5
SEQ = 48
VOCAB = nt.Axis("vocab", 64)


@dataclasses.dataclass
class Layout:
    """One mesh layout of the tiny config: its config, mesh plan, state target and compiled step."""

    config: object
    plan: object
    target: object
    step: object


def _layout(config, optimizer, schedule, devices, **trainer) -> Layout:
    from lm_train.run.compiled import CompiledStep, StateLayout
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.precision import parse_policy
    from lm_train.run.state import state_shapes
    from lm_train.run.step import StepSettings, make_train_step

    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, **trainer))
    plan = plan_mesh(config.trainer, devices=devices)
    settings = StepSettings.of_config(config, 1, parse_policy("f32"))
    target = state_shapes(config, plan, VOCAB, optimizer)
    step = CompiledStep(
        make_train_step(optimizer, settings, schedule), StateLayout(target), plan, config.model.Pos, "batch"
    )
    return Layout(config, plan, target, step)


def _params(state) -> list[np.ndarray]:
    from lm_train.run.state import trainable

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(trainable(state.model)))]


@pytest.fixture(scope="module")
def runs(tiny_project, tmp_path_factory):
    """Five steps on one device and under context 4 x data 2; the latter's checkpoint resumed under data 4 and under
    its own layout for a sixth step (which the one-device run takes too)."""
    from lm_train.config import load_train_config
    from lm_train.optim import build_optimizer
    from lm_train.run.checkpoints import restore_state
    from lm_train.run.state import init_state

    # 48 positions: a length that no weight axis has, so that the compiled program's shapes tell positions apart.
    config, _ = load_train_config([tiny_project.config], ["--trainer.mp", "f32", "--model.seq_len", str(SEQ)])
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    devices = jax.devices()
    one = _layout(config, optimizer, schedule, devices[:1])
    ring = _layout(config, optimizer, schedule, devices[:8], context_axis_size=4)
    data4 = _layout(config, optimizer, schedule, devices[:4])
    rng = np.random.default_rng(0)
    # A learnable stream (token t+1 = token t + 1 mod 64), so that the steps move the weights.
    batches = [((rng.integers(0, 64, (8, 1)) + np.arange(SEQ)) % 64).astype(np.int32) for _ in range(STEPS + 1)]

    def train(layout: Layout, state, steps):
        metrics = []
        for batch in steps:
            state, m = layout.step(state, batch)
            metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
        return state, metrics

    out = {"hlo": ring.step.lower(ring.target, 8).compile().as_text()}
    state, out["one"] = train(one, init_state(one.config, one.plan, VOCAB, optimizer), batches[:STEPS])
    out["one_params_5"] = _params(state)
    state, sixth = train(one, state, batches[STEPS:])
    out["one"] += sixth

    state, out["ring"] = train(ring, init_state(ring.config, ring.plan, VOCAB, optimizer), batches[:STEPS])
    out["ring_params_5"] = _params(state)
    path = tmp_path_factory.mktemp("context") / "step-5"
    dist_ckpt.save(state, path, step=STEPS, block=True, progress=False)
    state, out["ring_6"] = train(ring, state, batches[STEPS:])
    out["ring_params_6"] = _params(state)
    again, out["ring_again_6"] = train(ring, restore_state(path, ring.target), batches[STEPS:])
    out["ring_again_params_6"] = _params(again)
    resumed, out["data4_6"] = train(data4, restore_state(path, data4.target), batches[STEPS:])
    out["data4_params_6"] = _params(resumed)
    return out


def _close(a, b, rtol=1e-5, atol=0.0):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def test_context_4_x_data_2_trains_as_one_device_does(runs):
    for key in ("train/loss", "optim/grad_norm"):
        _close([m[key] for m in runs["ring"]], [m[key] for m in runs["one"][:STEPS]])
    for got, want in zip(runs["ring_params_5"], runs["one_params_5"], strict=True):
        _close(got, want, atol=1e-5)
    # The steps did move the weights, so the comparison above is not of the initial values.
    first = runs["one"][0]["train/loss"]
    assert runs["one"][STEPS - 1]["train/loss"] < first


def test_the_compiled_step_passes_keys_round_the_ring_and_gathers_none(runs):
    hlo = runs["hlo"]
    assert "collective-permute" in hlo
    # FSDP gathers weights over `data`, and GPT-2's (position, embed) table is gathered whole; but no all-gather
    # may produce activations of the whole sequence (a gathered key or value: batch, all 48 positions, heads, ...).
    shapes = [
        [int(n) for n in re.findall(r"\d+", match)]
        for match in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo)
    ]
    assert shapes, "the step gathers FSDP's weights: the pattern above must find all-gathers"
    assert not [shape for shape in shapes if SEQ in shape and len(shape) >= 3], shapes


def test_a_checkpoint_resumes_under_data_4_with_the_same_next_step_and_bitwise_under_its_own_layout(runs):
    for key in ("train/loss", "optim/grad_norm"):
        _close(runs["data4_6"][0][key], runs["ring_6"][0][key])
        _close(runs["ring_6"][0][key], runs["one"][STEPS][key])
    for got, want in zip(runs["data4_params_6"], runs["ring_params_6"], strict=True):
        _close(got, want, atol=1e-5)
    assert runs["ring_again_6"] == runs["ring_6"]
    for got, want in zip(runs["ring_again_params_6"], runs["ring_params_6"], strict=True):
        np.testing.assert_array_equal(got, want)
