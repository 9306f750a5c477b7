"""JsonlTracker: lines read back with the json module, plain numbers, resume truncation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import trackers


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_log_call_is_one_object_with_plain_numbers(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with trackers.JsonlTracker(path) as tracker:
        tracker.log({"train/loss": np.float32(2.5), "optim/learning_rate": 1e-3}, step=np.int64(10))
        tracker.log({"eval/loss": np.array(1.25), "tokens": np.int32(4096), "diverged": np.bool_(False)}, step=20)
        tracker.log({"train/loss": math.nan, "grad/max": math.inf}, step=30)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    assert _lines(path) == [
        {"step": 10, "train/loss": 2.5, "optim/learning_rate": 1e-3},
        {"step": 20, "eval/loss": 1.25, "tokens": 4096, "diverged": False},
        {"step": 30, "train/loss": None, "grad/max": None},
    ]
    assert [type(v) for v in _lines(path)[1].values()] == [int, float, int, bool]
    assert trackers.read_jsonl(path) == _lines(path)


def test_histogram_and_text_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    values = np.array([0.0, 0.5, 1.0, 2.0])
    reference_counts, reference_edges = np.histogram(values, bins=2)
    with trackers.JsonlTracker(path) as tracker:
        tracker.log({"weights": trackers.Histogram.from_values(values, bins=2), "sample": "the cat"}, step=1)
    [entry] = _lines(path)
    assert entry["sample"] == "the cat"
    assert entry["weights"]["counts"] == reference_counts.tolist()
    assert entry["weights"]["edges"] == reference_edges.tolist()
    assert entry["weights"]["num"] == 4
    assert entry["weights"]["sum_squares"] == pytest.approx(5.25)


def test_hyperparameters_and_summary_go_to_sidecar_files(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with trackers.JsonlTracker(path) as tracker:
        tracker.log_hyperparameters({"optimizer": {"learning_rate": np.float32(0.5)}})
        tracker.log_summary({"eval/loss": 3.0})
        tracker.log_summary({"tokens": 100})
        tracker.log({"train/loss": 1.0}, step=0)
    assert json.loads((tmp_path / "metrics.hparams.json").read_text()) == {"optimizer": {"learning_rate": 0.5}}
    assert json.loads((tmp_path / "metrics.summary.json").read_text()) == {"eval/loss": 3.0, "tokens": 100}
    assert _lines(path) == [{"step": 0, "train/loss": 1.0}]


def test_resume_drops_entries_at_or_after_the_resume_step_and_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with trackers.JsonlTracker(path) as tracker:
        for step in range(0, 50, 10):
            tracker.log({"train/loss": float(step)}, step=step)
    # the run died after step 40, but the last checkpoint is step 20: steps 20..40 are redone
    with trackers.JsonlTracker(path, resume_from_step=20) as tracker:
        assert [e["step"] for e in _lines(path)] == [0, 10]
        for step in range(20, 40, 10):
            tracker.log({"train/loss": -float(step)}, step=step)
    assert _lines(path) == [
        {"step": 0, "train/loss": 0.0},
        {"step": 10, "train/loss": 10.0},
        {"step": 20, "train/loss": -20.0},
        {"step": 30, "train/loss": -30.0},
    ]


def test_a_torn_last_line_is_dropped_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "train/loss": 1.0}\n{"step": 1, "train/lo')
    with trackers.JsonlTracker(path) as tracker:
        tracker.log({"train/loss": 2.0}, step=1)
    assert _lines(path) == [{"step": 0, "train/loss": 1.0}, {"step": 1, "train/loss": 2.0}]


def test_a_corrupt_middle_line_stops_a_resume_without_changing_the_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    original = '{"step": 0}\nnot json\n{"step": 5}\n'
    path.write_text(original)
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        trackers.JsonlTracker(path, resume_from_step=3)
    assert path.read_text() == original


def test_bad_values_are_refused_with_the_metric_name(tmp_path):
    with trackers.JsonlTracker(tmp_path / "m.jsonl") as tracker:
        with pytest.raises(trackers.MetricValueError, match=r"'train/loss' is an array of shape \(3,\)"):
            tracker.log({"train/loss": np.zeros(3)}, step=0)
        with pytest.raises(trackers.MetricValueError, match=r"'x' is a NoneType"):
            tracker.log({"x": None}, step=0)
        with pytest.raises(ValueError, match="may not be named 'step'"):
            tracker.log({"step": 1}, step=0)
        with pytest.raises(TypeError, match="step must be an integer"):
            tracker.log({"a": 1}, step=1.5)
    assert (tmp_path / "m.jsonl").read_text() == ""
    with pytest.raises(trackers.FinishedTrackerError):
        tracker.log({"a": 1}, step=0)


def test_a_resumed_run_merges_into_the_earlier_summary(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with trackers.JsonlTracker(path) as tracker:
        tracker.log_summary({"eval/loss": 3.0, "tokens": 10})
    with trackers.JsonlTracker(path, resume_from_step=0) as tracker:
        tracker.log_summary({"tokens": 20})
    assert json.loads((tmp_path / "metrics.summary.json").read_text()) == {"eval/loss": 3.0, "tokens": 20}
