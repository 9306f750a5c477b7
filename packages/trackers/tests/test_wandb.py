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


CHECK = """
import sys
import trackers
mode = {"mode": sys.argv[1]} if sys.argv[1] else {}
config = trackers.tracker_config_from_dict({"type": "wandb", "project": "p", **mode})
try:
    trackers.check_trackers_ready([config], process_index=0, where="trainer.tracker")
except trackers.TrackerConfigError as error:
    print("refused:", error)
else:
    print("ready")
"""


def _check_in_a_fresh_process(tmp_path: Path, mode: str, env: dict[str, str]) -> str:
    """check_trackers_ready on a wandb config in a new interpreter: wandb reads its environment once a process."""
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    clean.update(HOME=str(home), NETRC=str(home / "netrc"), WANDB_CONFIG_DIR=str(home / "config"), **env)
    done = subprocess.run(
        [sys.executable, "-c", CHECK, mode], env=clean, cwd=home, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_online_run_without_an_api_key_is_refused_before_it_starts(tmp_path):
    refused = _check_in_a_fresh_process(tmp_path, "", {})
    assert refused.startswith("refused: trainer.tracker (type 'wandb'): wandb would log online, but no API key")
    for fix in ("`wandb login`", "WANDB_API_KEY", "WANDB_MODE=offline", "`mode: offline`"):
        assert fix in refused, fix
    assert not (tmp_path / "home" / "wandb").exists()  # no run was started
    # Offline by the tracker section or by the environment, or a key as `wandb login` leaves one: ready.
    assert _check_in_a_fresh_process(tmp_path, "offline", {}) == "ready"
    assert _check_in_a_fresh_process(tmp_path, "", {"WANDB_MODE": "offline"}) == "ready"
    assert _check_in_a_fresh_process(tmp_path, "", {"WANDB_API_KEY": "k" * 40}) == "ready"
    assert "not usable" in _check_in_a_fresh_process(tmp_path, "online", {"WANDB_API_KEY": "short"})
