"""The current-tracker context and the module-level log functions."""

from __future__ import annotations

import json
import threading

import pytest

import trackers


def _entries(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_goes_to_the_innermost_current_tracker(tmp_path):
    outer_path, inner_path = tmp_path / "outer.jsonl", tmp_path / "inner.jsonl"
    outer, inner = trackers.JsonlTracker(outer_path), trackers.JsonlTracker(inner_path)
    with outer, inner, trackers.use_tracker(outer):
        trackers.log({"a": 1}, step=0)
        with trackers.use_tracker(inner):
            assert trackers.current_tracker() is inner
            trackers.log({"a": 2}, step=1)
            trackers.log_summary({"best": 2})
            trackers.log_hyperparameters({"lr": 0.1})
        trackers.log({"a": 3}, step=2)
    assert _entries(outer_path) == [{"step": 0, "a": 1}, {"step": 2, "a": 3}]
    assert _entries(inner_path) == [{"step": 1, "a": 2}]
    assert json.loads((tmp_path / "inner.summary.json").read_text()) == {"best": 2}
    assert json.loads((tmp_path / "inner.hparams.json").read_text()) == {"lr": 0.1}


def test_other_threads_see_the_current_tracker(tmp_path):
    # jax runs jit_log callbacks on its own threads, so the context must not be thread-local
    path = tmp_path / "m.jsonl"
    with trackers.JsonlTracker(path) as tracker, trackers.use_tracker(tracker):
        worker = threading.Thread(target=trackers.log, args=({"from_thread": 1}, 4))
        worker.start()
        worker.join()
    assert _entries(path) == [{"step": 4, "from_thread": 1}]


def test_no_current_tracker_is_a_clear_error():
    with pytest.raises(trackers.NoCurrentTrackerError, match=r"with trackers.use_tracker\(tracker\)"):
        trackers.log({"a": 1}, step=0)


def test_the_context_is_left_even_when_the_block_raises(tmp_path):
    tracker = trackers.NoopTracker()
    with pytest.raises(KeyError), trackers.use_tracker(tracker):
        raise KeyError("boom")
    with pytest.raises(trackers.NoCurrentTrackerError):
        trackers.current_tracker()
