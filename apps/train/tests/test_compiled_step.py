"""The compiled train step: compiling ahead of the first batch gives the same program, compiled once."""

from pathlib import Path

import jax
import numpy as np

import named_tensors as nt
from lm_train.config import load_train_config
from lm_train.optim import build_optimizer
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state, state_shapes
from lm_train.run.step import StepSettings, make_train_step

CONFIG = Path(__file__).parents[3] / "configs" / "gpt2_nano.yaml"
TINY = ["--model.hidden_dim", "32", "--model.num_layers", "2", "--model.seq_len", "16"]
TINY += ["--trainer.train_batch_size", "8", "--trainer.num_train_steps", "4"]

backend_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: (
        backend_compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
)


def build():
    """A fresh tiny GPT-2 state and its compiled step, as lm_train.run.loop.train sets them up."""
    config, _ = load_train_config([CONFIG], TINY)
    plan = plan_mesh(config.trainer)
    Vocab = nt.Axis("vocab", 64)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0, config.trainer.batch_axis)
    step = CompiledStep(
        make_train_step(optimizer, settings, schedule),
        StateLayout(state_shapes(config, plan, Vocab, optimizer)),
        plan,
        config.model.Pos,
        config.trainer.batch_axis,
    )
    return init_state(config, plan, Vocab, optimizer), step


def test_precompiled_step_compiles_nothing_more_and_computes_the_same_bits():
    batches = np.random.default_rng(0).integers(0, 64, size=(2, 8, 16), dtype=np.int32)

    state, step = build()
    backend_compiles.clear()
    step.precompile(state, 8)
    assert backend_compiles, "precompile compiled nothing"
    backend_compiles.clear()
    for batch in batches:
        state, metrics = step(state, batch)
    assert backend_compiles == [], "the first step compiled again after precompile"

    ref_state, ref_step = build()
    for batch in batches:
        ref_state, ref_metrics = ref_step(ref_state, batch)
    assert float(metrics["train/loss"]) == float(ref_metrics["train/loss"])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_batch_size_schedule_compiles_the_step_once_per_distinct_size():
    """Steps of 8, 8, 16, 16, 8, 8 examples (a schedule that grows, then shrinks back) compile the step twice: at
    the first step of each new size, and not again when an earlier size comes back."""
    stages = "[{start: 0, value: 8}, {start: 2, value: 16}, {start: 4, value: 8}]"
    config, _ = load_train_config([CONFIG], [*TINY, "--trainer.train_batch_size", stages])
    sizes = [config.trainer.batch_schedule.size_at(step) for step in range(6)]
    assert sizes == [8, 8, 16, 16, 8, 8]
    state, step = build()
    rng = np.random.default_rng(1)
    compiles_per_step = []
    for size in sizes:
        backend_compiles.clear()
        state, metrics = step(state, rng.integers(0, 64, size=(size, 16), dtype=np.int32))
        compiles_per_step.append(len(backend_compiles))
    assert np.isfinite(float(metrics["train/loss"]))
    assert compiles_per_step == [1, 0, 1, 0, 0, 0]
