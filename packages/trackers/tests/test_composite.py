"""CompositeTracker: fan-out, and errors collected until every tracker has been called."""

from __future__ import annotations

import json

import pytest

import trackers


class _Broken(trackers.NoopTracker):
    """A tracker whose every call fails, as a backend with a full disk would."""

    def __init__(self, message: str) -> None:
        self.message = message

    def log(self, metrics, step):
        raise OSError(self.message)

    def finish(self):
        raise OSError(f"{self.message} (finish)")


def test_fans_out_to_every_tracker(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with trackers.CompositeTracker([trackers.JsonlTracker(first), trackers.JsonlTracker(second)]) as tracker:
        tracker.log({"train/loss": 1.0}, step=3)
        tracker.log_summary({"done": True})
    for path in (first, second):
        assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 3, "train/loss": 1.0}]
        assert json.loads(path.with_name(f"{path.stem}.summary.json").read_text()) == {"done": True}


def test_failures_are_raised_together_after_all_trackers_ran(tmp_path):
    path = tmp_path / "after.jsonl"
    jsonl = trackers.JsonlTracker(path)
    composite = trackers.CompositeTracker([_Broken("disk full"), jsonl, _Broken("network down")])

    with pytest.raises(trackers.TrackerErrors) as caught:
        composite.log({"train/loss": 2.0}, step=7)
    # the healthy tracker behind the broken one still got the metrics
    assert json.loads(path.read_text()) == {"step": 7, "train/loss": 2.0}
    errors = caught.value.exceptions
    assert [str(e) for e in errors] == ["disk full", "network down"]
    assert all(isinstance(e, OSError) for e in errors)
    assert "2 of 3 trackers failed in log(step=7)" in str(caught.value)
    assert errors[0].__notes__ == ["raised by _Broken.log(step=7)"]

    with pytest.raises(trackers.TrackerErrors) as caught:
        composite.finish()
    assert len(caught.value.exceptions) == 2
    # finish reached the jsonl tracker between the two failures
    with pytest.raises(trackers.FinishedTrackerError):
        jsonl.log({"a": 1}, step=8)


def test_errors_can_be_handled_by_type_with_except_star():
    composite = trackers.CompositeTracker([_Broken("disk full"), trackers.NoopTracker()])
    handled = []
    try:
        composite.log({"a": 1.0}, step=0)
    except* OSError as group:
        handled.extend(str(e) for e in group.exceptions)
    assert handled == ["disk full"]


def test_refuses_things_that_are_not_trackers():
    with pytest.raises(TypeError, match="takes Tracker objects, got a dict"):
        trackers.CompositeTracker([{"type": "jsonl"}])
