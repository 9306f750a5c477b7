"""jit_log: logging from inside jit and scan reaches the current tracker, in order, with the right steps."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import trackers
from trackers import jit_log


def _entries(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_inside_jit_with_a_traced_step(tmp_path):
    path = tmp_path / "m.jsonl"

    @jax.jit
    def train_step(x, step):
        loss = jnp.mean(x * x)
        jit_log({"train/loss": loss, "train/max": jnp.max(x)}, step=step)
        return x * 0.5, step + 1

    x, step = jnp.arange(4.0), jnp.asarray(0)
    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        for _ in range(3):
            x, step = train_step(x, step)
    # leaving use_tracker waited for the callbacks: everything is on disk
    reference = np.arange(4.0)
    expected = []
    for i in range(3):
        expected.append({"step": i, "train/loss": float(np.mean(reference * reference)), "train/max": reference.max()})
        reference = reference * 0.5
    assert _entries(path) == expected


def test_inside_scan_each_iteration_has_its_own_step(tmp_path):
    path = tmp_path / "m.jsonl"

    @jax.jit
    def run(start_step):
        def body(carry, i):
            jit_log({"carry": carry}, step=start_step + i)
            return carry * 2.0, None

        return jax.lax.scan(body, jnp.asarray(1.0), jnp.arange(4))[0]

    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        run(jnp.asarray(10))
        run(jnp.asarray(20))
    assert _entries(path) == [{"step": 10 + i, "carry": 2.0**i} for i in range(4)] + [
        {"step": 20 + i, "carry": 2.0**i} for i in range(4)
    ]


def test_sharded_over_eight_devices_in_order(tmp_path):
    path = tmp_path / "m.jsonl"
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))

    @jax.jit
    def step_fn(x, step):
        def body(carry, i):
            jit_log({"inner": carry}, step=step * 100 + i)
            return carry + 1.0, None

        final = jax.lax.scan(body, jnp.sum(x), jnp.arange(2))[0]
        # this call's value depends on the scan, so it runs after the scan's calls
        jit_log({"after": final}, step=step)
        return x + 1.0

    x = jax.device_put(jnp.zeros(16), sharding)
    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        for step in range(1, 4):
            x = step_fn(x, jnp.asarray(step))
    expected = []
    for step in range(1, 4):
        total = 16.0 * (step - 1)
        expected += [{"step": step * 100, "inner": total}, {"step": step * 100 + 1, "inner": total + 1.0}]
        expected += [{"step": step, "after": total + 2.0}]
    assert _entries(path) == expected


def test_ordered_keeps_program_order_of_independent_calls(tmp_path):
    path = tmp_path / "m.jsonl"

    @jax.jit
    def fn(x, step):
        for name in ("a", "b", "c", "d"):
            jit_log({name: x}, step=step, ordered=True)
        return x

    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        fn(jnp.asarray(1.0), jnp.asarray(5))
    assert [next(k for k in entry if k != "step") for entry in _entries(path)] == ["a", "b", "c", "d"]


def test_histograms_from_summarize_tree_cross_the_jit_boundary(tmp_path):
    path = tmp_path / "m.jsonl"
    grads = {"w": jnp.arange(10.0, dtype=jnp.float32).reshape(2, 5)}

    @jax.jit
    def fn(tree, step):
        jit_log(trackers.summarize_tree(tree, "grad", bins=5), step=step)

    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        fn(grads, jnp.asarray(3))
    [entry] = _entries(path)
    counts, edges = np.histogram(np.arange(10.0), bins=5)
    assert entry["step"] == 3
    assert entry["grad/hist/w"]["counts"] == counts.tolist()
    assert entry["grad/hist/w"]["edges"] == pytest.approx(edges.tolist())
    assert entry["grad/norm/w"] == pytest.approx(np.linalg.norm(np.arange(10.0)))


def test_outside_jit_too(tmp_path):
    path = tmp_path / "m.jsonl"
    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        jit_log({"a": jnp.asarray(1.5), "b": 2}, step=7)
    assert _entries(path) == [{"step": 7, "a": 1.5, "b": 2}]


def test_strings_are_refused_at_trace_time():
    with pytest.raises(TypeError, match="cannot carry the string metric 'note' out of jit"):
        jax.jit(lambda step: jit_log({"note": "hi"}, step=step))(0)


def test_a_callback_without_current_tracker_fails_loudly():
    @jax.jit
    def fn(step):
        jit_log({"a": jnp.asarray(1.0)}, step=step)
        return step

    with pytest.raises(Exception, match="No current tracker"):  # jax wraps it in its runtime error
        fn(jnp.asarray(0)).block_until_ready()
        trackers.wait_for_jit_logs()


def test_deep_code_logs_at_the_step_of_the_enclosing_logging_step(tmp_path):
    path = tmp_path / "m.jsonl"

    def loss_fn(x):  # stands for model or loss code, which is not passed the step
        loss = jnp.sum(x)
        jit_log({"deep/loss": loss})
        return loss

    @jax.jit
    def train_step(x, step):
        with trackers.logging_step(step + 1):
            return x - jax.grad(loss_fn)(x)

    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        x = jnp.ones(3)
        for step in range(2):
            x = train_step(x, jnp.asarray(step))
    assert _entries(path) == [{"step": 1, "deep/loss": 3.0}, {"step": 2, "deep/loss": 0.0}]
    with pytest.raises(TypeError, match="jit_log needs a step"):
        jit_log({"x": 1.0})
