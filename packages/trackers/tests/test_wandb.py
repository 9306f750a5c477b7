"""WandbTracker in offline mode: a real run directory, read back from wandb's own record format."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import trackers


def _run_file(root: Path) -> Path:
    [run_dir] = list((root / "wandb").glob("offline-run-*"))
    [run_file] = list(run_dir.glob("run-*.wandb"))
    return run_file


def test_offline_run_records_history_summary_config_and_run_fields(tmp_path, wandb_dirs, wandb_reader):
    config = trackers.tracker_config_from_dict(
        {
            "type": "wandb",
            "project": "proj",
            "name": "tiny-run",
            "tags": ["a", "b"],
            "group": "grp",
            "id": "run123",
            "mode": "offline",
        }
    )
    histogram = trackers.Histogram.from_values([0.0, 1.0, 1.0, 3.0], bins=3)
    with config.build(tmp_path / "run") as tracker:
        tracker.log_hyperparameters({"optimizer": {"learning_rate": 0.01}, "seed": 3})
        for step in range(3):
            tracker.log({"train/loss": np.float32(2.0 - step), "count": np.int64(step)}, step=step)
        tracker.log({"grad/hist": histogram, "note": "hello"}, step=3)
        tracker.log_summary({"eval/loss": 0.5})

    run = wandb_reader(_run_file(tmp_path / "run"))
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in run["history"]]
    steps = [row["_step"] for row in run["history"]]
    assert steps == [0, 1, 2, 3]
    assert rows[:3] == [
        {"train/loss": 2.0, "count": 0},
        {"train/loss": 1.0, "count": 1},
        {"train/loss": 0.0, "count": 2},
    ]
    assert rows[3]["note"] == "hello"
    # wandb stores a histogram as nested keys under the metric's name
    assert rows[3]["grad/hist/_type"] == "histogram"
    assert rows[3]["grad/hist/values"] == [1, 2, 1]
    assert rows[3]["grad/hist/bins"] == [0, 1, 2, 3]
    assert run["summary"]["eval/loss"] == 0.5
    assert run["config"]["optimizer"] == {"learning_rate": 0.01}
    assert run["config"]["seed"] == 3
    assert run["run"].run_id == "run123"
    assert run["run"].project == "proj"
    assert run["run"].display_name == "tiny-run"
    assert run["run"].run_group == "grp"
    assert list(run["run"].tags) == ["a", "b"]


def test_offline_artifact_is_recorded(tmp_path, wandb_dirs, wandb_reader):
    payload = tmp_path / "weights.txt"
    payload.write_text("0.5\n")
    with trackers.WandbTracker(project="proj", mode="offline", dir=tmp_path / "run") as tracker:
        tracker.log_artifact(payload, name="final-weights", type="model")
    run = wandb_reader(_run_file(tmp_path / "run"))
    assert [(a.name, a.type) for a in run["artifacts"]] == [("final-weights", "model")]
