"""trainer.watch inside a compiled step, and the run tracker that jit_log reaches (real jsonl and TensorBoard)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import named_tensors as nt
import trackers
from lm_train.config import TrackerList, WatchConfig
from lm_train.errors import ConfigError
from lm_train.run.run_dir import RunPaths
from lm_train.run.tracking import run_tracker, tracker_configs
from lm_train.run.watch import make_watch, watch_metrics


def _tree():
    stacked = nt.named(jnp.arange(24.0).reshape(3, 8) / 10, ("layers", "embed"))
    return {"blocks": stacked, "head": nt.named(jnp.ones(4), ("vocab",))}


def test_metrics_follow_the_flags():
    tree = _tree()
    targets = {"grads": tree, "params": tree, "updates": tree, "opt_state": (jnp.asarray(3), tree)}
    full = watch_metrics(WatchConfig(watch_targets=("grads", "opt_state")), targets)
    per_layer = [np.linalg.norm(np.arange(24.0).reshape(3, 8)[i] / 10) for i in range(3)]
    for i in range(3):
        assert float(full[f"grads/norm/blocks/layer_{i}"]) == pytest.approx(per_layer[i], rel=1e-6)
    total = np.sqrt(sum(x * x for x in per_layer) + 4.0)
    assert float(full["grads/norm/total"]) == pytest.approx(total, rel=1e-6)
    assert "opt_state/norm/total" in full and not any("/hist/" in k for k in full)  # int leaves skipped
    whole = watch_metrics(
        WatchConfig(watch_targets=("params",), split_scan_layers=False, include_histograms=True), targets
    )
    assert "params/norm/blocks" in whole and "params/hist/blocks" in whole
    only_total = watch_metrics(WatchConfig(watch_targets=("grads",), include_per_parameter_norms=False), targets)
    assert set(only_total) == {"grads/norm/total"}
    assert make_watch(WatchConfig()) is None  # off by default: the step gets no watch at all
    with pytest.raises(ConfigError, match="unknown target"):
        WatchConfig(watch_targets=("gradients",))


def test_watch_logs_inside_jit_only_on_interval_steps(tmp_path):
    watch = make_watch(WatchConfig(watch_targets=("grads",), interval=2))
    tree = _tree()

    @jax.jit
    def step_fn(step):
        watch(step=step, grads=tree, params=tree, updates=tree, opt_state=())
        return step + 1

    path = tmp_path / "m.jsonl"
    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        for step in range(1, 6):
            step_fn(jnp.asarray(step))
    logged = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert logged == [2, 4]


def test_run_tracker_makes_jit_log_reach_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = RunPaths(tmp_path / "run")
    paths.create()
    configured = TrackerList(trackers.tracker_configs_from_value({"type": "tensorboard"}))
    assert isinstance(tracker_configs(configured, paths)[0], trackers.JsonlConfig)  # jsonl always first

    @jax.jit
    def loss_code(x, step):
        with trackers.logging_step(step):
            trackers.jit_log({"deep/value": jnp.sum(x)})  # as model or loss code would, without a step
        return optax.tree.norm(x)

    with run_tracker(configured, paths, process_index=0, resume_from_step=None):
        for step in (1, 2):
            loss_code(jnp.full(3, float(step)), jnp.asarray(step))
    rows = [json.loads(line) for line in paths.metrics_file.read_text().splitlines()]
    assert rows == [{"step": 1, "deep/value": 3.0}, {"step": 2, "deep/value": 6.0}]
    events = EventAccumulator(str(paths.run_dir / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("deep/value")] == [3.0, 6.0]
    assert dataclasses.is_dataclass(configured[0])
