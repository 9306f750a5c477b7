"""TensorboardTracker: event files read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trackers


def _accumulator(logdir):
    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_scalars_histograms_and_text_read_back(tmp_path):
    values = np.array([-1.0, 0.0, 0.25, 0.5, 3.0])
    histogram = trackers.Histogram.from_values(values, bins=4)
    config = trackers.tracker_config_from_dict({"type": "tensorboard", "logdir": "tb"})
    with config.build(tmp_path) as tracker:
        for step in range(3):
            tracker.log({"train/loss": np.float32(1.5 * step), "optim/learning_rate": 0.1}, step=step)
        tracker.log({"params/hist": histogram, "samples/text": "hello world"}, step=3)
        tracker.log_hyperparameters({"model": {"hidden_dim": 64}})

    accumulator = _accumulator(tmp_path / "tb")
    assert set(accumulator.Tags()["scalars"]) == {"train/loss", "optim/learning_rate"}
    loss = accumulator.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(0, 0.0), (1, 1.5), (2, 3.0)]
    assert [e.value for e in accumulator.Scalars("optim/learning_rate")] == pytest.approx([0.1] * 3)

    [event] = accumulator.Histograms("params/hist")
    counts, edges = np.histogram(values, bins=4)
    assert event.step == 3
    assert event.histogram_value.num == 5
    assert event.histogram_value.min == -1.0 and event.histogram_value.max == 3.0
    assert event.histogram_value.sum == pytest.approx(values.sum())
    assert event.histogram_value.sum_squares == pytest.approx((values * values).sum())
    assert list(event.histogram_value.bucket) == counts.tolist()
    assert list(event.histogram_value.bucket_limit) == pytest.approx(edges[1:].tolist())

    # tensorboardX files text under "<tag>/text_summary"
    [text] = accumulator.Tensors("samples/text/text_summary")
    assert text.step == 3
    assert text.tensor_proto.string_val == [b"hello world"]
    [hparams] = accumulator.Tensors("hyperparameters/text_summary")
    assert b"| model/hidden_dim | 64 |" in hparams.tensor_proto.string_val[0]


def test_resume_writes_a_purge_step(tmp_path):
    with trackers.TensorboardTracker(tmp_path) as tracker:
        for step in range(4):
            tracker.log({"train/loss": float(step)}, step=step)
    with trackers.TensorboardConfig(logdir=".").build(tmp_path, resume_from_step=2) as tracker:
        for step in range(2, 4):
            tracker.log({"train/loss": -float(step)}, step=step)
    loss = _accumulator(tmp_path).Scalars("train/loss")
    # TensorBoard drops the first run's events at step >= 2 when it meets the purge marker
    assert [(e.step, e.value) for e in loss] == [(0, 0.0), (1, 1.0), (2, -2.0), (3, -3.0)]


def test_without_resume_step_both_runs_stay_visible(tmp_path):
    # the control for the test above: no purge marker, so TensorBoard keeps the doubled steps
    for sign in (1.0, -1.0):
        with trackers.TensorboardTracker(tmp_path) as tracker:
            for step in range(2, 4):
                tracker.log({"train/loss": sign * step}, step=step)
    loss = _accumulator(tmp_path).Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(2, 2.0), (3, 3.0), (2, -2.0), (3, -3.0)]
