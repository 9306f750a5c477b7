"""Pipeline parallelism on 8 CPU devices, in process from lm_train's own pieces: pipeline 2 x data 2 x model 2
against one device (losses, grad norms, parameters), the compiled program's collective permutes, a checkpoint
saved under the pipeline resumed without it, a bitwise rerun under the same layout, and pipeline 2 x context 2 x
data 2 (ring attention inside the stages) against one device."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import dist_ckpt
import named_tensors as nt

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# configs/llama_nano.yaml (a Llama-style decoder), narrower and shorter so that five steps take seconds.
NANO = ["--model.hidden_dim", "64", "--model.intermediate_dim", "128", "--model.seq_len", "32"]
NANO += ["--trainer.train_batch_size", "8", "--trainer.mp", "f32", "--optimizer.warmup", "0"]
# Adam's epsilon above the tiniest gradients: at 1e-8 Adam moves a weight whose gradient is ~1e-9 by ~lr x sign, so
# the rounding of a reordered sum (microbatches, shards) moved a rare weight by 1e-5 to 1e-4 (seen in 2 of 3 runs).
NANO += ["--optimizer.epsilon", "1e-5"]
PIPELINE = ["--trainer.pipeline_axis_size", "2", "--trainer.model_axis_size", "2"]  # stage 2 x data 2 x model 2
RING = ["--trainer.pipeline_axis_size", "2", "--trainer.context_axis_size", "2"]  # stage 2 x data 2 x context 2
VOCAB = 64
STEPS = 5


@dataclass
class Layout:
    """A run's config, mesh plan and compiled step under one layout."""

    config: Any
    plan: Any
    step: Any
    optimizer: Any
    target: Any


def layout(devices: list[jax.Device], *overrides: str) -> Layout:
    from lm_train.config import load_train_config
    from lm_train.optim import build_optimizer
    from lm_train.run.compiled import CompiledStep, StateLayout
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.pipeline_checks import check_pipeline
    from lm_train.run.state import state_shapes
    from lm_train.run.step import StepSettings, make_train_step

    config, _ = load_train_config([REPO / "configs" / "llama_nano.yaml"], [*NANO, *overrides])
    plan = plan_mesh(config.trainer, devices=devices)
    check_pipeline(config, plan, 1)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    target = state_shapes(config, plan, nt.Axis("vocab", VOCAB), optimizer)
    settings = StepSettings.of_config(config, 1)
    step_fn = make_train_step(optimizer, settings, schedule)
    step = CompiledStep(step_fn, StateLayout(target), plan, config.model.Pos, config.trainer.batch_axis)
    return Layout(config, plan, step, optimizer, target)


def fresh_state(run: Layout) -> Any:
    from lm_train.run.state import init_state

    return init_state(run.config, run.plan, nt.Axis("vocab", VOCAB), run.optimizer)


def train(run: Layout, state: Any, batches: list[np.ndarray]) -> tuple[Any, list[tuple[float, float]]]:
    curve = []
    for batch in batches:
        state, metrics = run.step(state, batch)
        curve.append((float(metrics["train/loss"]), float(metrics["optim/grad_norm"])))
    return state, curve


def weights(state: Any) -> list[np.ndarray]:
    from lm_train.run.state import trainable

    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainable(state.model)))]


def assert_same_weights(actual: np.ndarray, expected: np.ndarray) -> None:
    """Each weight within 1e-5 of the reference."""
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Five steps on one device and under the pipeline, a checkpoint at step 5, and the sixth step three ways."""
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, VOCAB, size=(8, 32)).astype(np.int32) for _ in range(STEPS + 1)]
    one = layout(jax.devices()[:1])
    reference, one_curve = train(one, fresh_state(one), batches[:STEPS])

    piped = layout(jax.devices(), *PIPELINE)
    state = fresh_state(piped)
    hlo = piped.step.precompile(state, 8).as_text()  # the executable the steps below run
    state, pipe_curve = train(piped, state, batches[:STEPS])
    pipe_weights = weights(state)
    checkpoint = tmp_path_factory.mktemp("pipeline") / "step-5"
    dist_ckpt.save(state.checkpointed(), checkpoint, step=STEPS, block=True, progress=False)
    state, pipe_sixth = train(piped, state, batches[STEPS:])

    # The same layout again, from the same start: every bit the same.
    again, again_curve = train(piped, fresh_state(piped), batches)

    # The pipeline's checkpoint, resumed by a run without a pipeline (data 8).
    from lm_train.run.checkpoints import restore_state

    plain = layout(jax.devices())
    resumed = restore_state(checkpoint, plain.target)
    resumed, plain_sixth = train(plain, resumed, batches[STEPS:])

    # Ring attention's shard_map inside the stages' vmap: pipeline 2 x context 2 x data 2.
    ring = layout(jax.devices(), *RING)
    ring_state = fresh_state(ring)
    ring_hlo = ring.step.precompile(ring_state, 8).as_text()
    ring_state, ring_curve = train(ring, ring_state, batches[:STEPS])
    return {
        "one_curve": one_curve,
        "one_weights": weights(reference),
        "pipe_curve": pipe_curve,
        "pipe_weights": pipe_weights,
        "hlo": hlo,
        "pipe_sixth": pipe_sixth,
        "pipe_final": weights(state),
        "again_curve": again_curve,
        "again_final": weights(again),
        "plain_sixth": plain_sixth,
        "plain_final": weights(resumed),
        "plain_mesh": dict(plain.plan.mesh.shape),
        "pipe_mesh": dict(piped.plan.mesh.shape),
        "ring_curve": ring_curve,
        "ring_weights": weights(ring_state),
        "ring_hlo": ring_hlo,
        "ring_mesh": dict(ring.plan.mesh.shape),
    }


def permute_strides(hlo: str) -> set[frozenset[int]]:
    """For each collective permute of the program, the distances |target - source| between the devices it pairs."""
    found = set()
    for pairs in re.findall(r"collective-permute(?:-start)?\(.*?source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", hlo):
        found.add(frozenset(abs(int(b) - int(a)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)))
    return found


def test_pipeline_matches_one_device(runs):
    assert runs["pipe_mesh"] == {"replica": 1, "stage": 2, "data": 2, "context": 1, "expert": 1, "model": 2}
    np.testing.assert_allclose(runs["pipe_curve"], runs["one_curve"], rtol=1e-5)
    for piped, single in zip(runs["pipe_weights"], runs["one_weights"], strict=True):
        assert_same_weights(piped, single)


def test_activations_move_by_collective_permutes(runs):
    hlo = runs["hlo"]
    # The shift between neighbouring stages (jnp.roll over the stage-sharded dimension): stage 0's devices 0-3
    # send to stage 1's devices 4-7 and back.
    permutes = re.findall(r"collective-permute(?:-start)?\(.*source_target_pairs=\{([^}]*\}[^}]*)\}", hlo)
    assert any("{0,4}" in pairs for pairs in permutes), permutes
    # No all-gather comes from the shift (only FSDP's weight gathers remain).
    gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)]
    assert gathers and not [line for line in gathers if "_roll" in line]


def test_pipeline_checkpoint_resumes_without_the_pipeline(runs):
    assert runs["plain_mesh"] == {"replica": 1, "stage": 1, "data": 8, "context": 1, "expert": 1, "model": 1}
    np.testing.assert_allclose(runs["plain_sixth"], runs["pipe_sixth"], rtol=1e-5)
    for plain, piped in zip(runs["plain_final"], runs["pipe_final"], strict=True):
        assert_same_weights(plain, piped)


def test_rerun_under_the_same_layout_is_bitwise(runs):
    assert runs["again_curve"] == runs["pipe_curve"] + runs["pipe_sixth"]
    for a, b in zip(runs["again_final"], runs["pipe_final"], strict=True):
        assert np.array_equal(a, b)


def test_pipeline_with_ring_attention_matches_one_device(runs):
    assert runs["ring_mesh"] == {"replica": 1, "stage": 2, "data": 2, "context": 2, "expert": 1, "model": 1}
    np.testing.assert_allclose(runs["ring_curve"], runs["one_curve"], rtol=1e-5)
    for ring, single in zip(runs["ring_weights"], runs["one_weights"], strict=True):
        assert_same_weights(ring, single)
    # Devices are numbered stage x data x context: the stages' shift pairs devices 4 apart (0 -> 4), the ring passes
    # key/value blocks between the context neighbours 1 apart (0 -> 1). Both kinds are in the compiled step.
    strides = permute_strides(runs["ring_hlo"])
    assert frozenset({4}) in strides and frozenset({1}) in strides, strides
