"""A run on several hosts (2 processes x 4 CPU devices, the real CLI): time-based checkpoints decided by process
0's clock alone, with another host's clock skewed by minutes; per-host step times that name a straggler; the
watchdog that ends a run where a host stopped stepping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import dist_ckpt
import trackers

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LM_TRAIN = [sys.executable, "-m", "lm_train"]
# These runs write nothing into the persistent compilation cache of the tiny project's cache directory, which the
# other 2-process runs of the session share: they leave those runs as they would be without them.
NO_COMPILE_CACHE = ["--trainer.compilation_cache", "false"]
SKEW_S = 600  # process 1's clock jumps ten minutes ahead: by its own clock, every step would be past the interval

DECIDING = """\
trainer:
  num_train_steps: 12
  log_every: 4
  checkpointer:
    save_interval: 1s
    keep:
      - every: 6
"""


def committed_steps(checkpoints: Path) -> set[int]:
    """The steps whose checkpoint is committed now (a temporary one may vanish at any moment)."""
    steps = set()
    for marker in checkpoints.glob("step-*/COMMITTED"):
        try:
            steps.add(int(marker.parent.name.removeprefix("step-")))
        except ValueError:
            continue
    return steps


@pytest.fixture(scope="module")
def skewed_run(tiny_project, tmp_path_factory, launch):
    """12 steps with a 1 s save interval; process 1 sleeps 0.4 s a step (so the timer fires several times in the
    run) and its checkpoint clock is ten minutes ahead. Returns the run directory, the results, and every step
    seen committed while the run ran (temporary ones are deleted once a newer one is complete)."""
    run_dir = tiny_project.root / "runs" / "skewed-clock"
    extra = tiny_project.write_config("deciding.yaml", DECIDING)
    args = [*LM_TRAIN, "run", str(tiny_project.config), str(extra), "--trainer.run_dir", str(run_dir)]
    args += ["--data.validation_urls", "[]", *NO_COMPILE_CACHE]
    slow = {"LM_TRAIN_STEP_DELAY_S": "0.4", "LM_TRAIN_TEST_CLOCK_SKEW_S": str(SKEW_S)}
    seen: set[int] = set()

    def watch() -> bool:  # polled every 0.1 s while the processes run; never asks to kill them
        seen.update(committed_steps(run_dir / "checkpoints"))
        return False

    results = launch(
        args,
        2,
        cwd=tiny_project.root,
        log_dir=tmp_path_factory.mktemp("skewed"),
        env=lambda rank: slow if rank == 1 else {},
        timeout=300,  # a disagreement about a save leaves one process alone in the save's barrier: a hang
        kill_when=watch,
    )
    return run_dir, results, seen


def test_process_0s_clock_alone_decides_time_based_saves_and_old_ones_are_deleted(skewed_run):
    run_dir, results, seen = skewed_run
    assert [r.returncode for r in results] == [0, 0]
    temporaries = seen - {6, 12}
    # The timer fired during the run (by process 0's clock), and both processes saved those steps: a checkpoint
    # commits only once every process has written its part.
    assert temporaries, f"no time-based checkpoint was seen; committed steps seen: {sorted(seen)}"
    assert seen <= set(range(1, 13))
    # Each temporary was deleted once a newer checkpoint was complete; the keep policy's steps stay.
    infos = dist_ckpt.list_checkpoints(run_dir / "checkpoints")
    assert [(info.step, info.committed, info.temporary) for info in infos] == [(6, True, False), (12, True, False)]
    for step in (6, 12):
        manifest = dist_ckpt.read_manifest(run_dir / "checkpoints" / f"step-{step}")
        assert manifest["process_count"] == 2 and manifest["step"] == step


def test_per_host_step_times_name_the_slow_host_at_every_log_step(skewed_run):
    run_dir, _, _ = skewed_run
    rows = [row for row in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [4, 8, 12]
    for row in rows:
        # Process 1 sleeps 0.4 s after each step (3 of the first window's 4 steps, 4 of the others'); process 0
        # spends most of each step waiting for it in the step's collectives, which is not its own time.
        assert row["hosts/slowest_host"] == 1, row
        assert row["hosts/step_time_max"] >= 0.3, row
        assert row["hosts/step_time_min"] < 0.5 * row["hosts/step_time_max"], row
        assert row["hosts/step_time_min"] <= row["hosts/step_time_mean"] <= row["hosts/step_time_max"]


STALLING = """\
trainer:
  num_train_steps: 40
  log_every: 1
  checkpointer:
    save_interval: 1h
    keep:
      - every: 100
  watchdog:
    timeout_s: 8
"""


def test_a_host_that_stops_stepping_ends_the_run_with_every_stack_dumped(tiny_project, tmp_path, launch):
    run_dir = tiny_project.root / "runs" / "stalled"
    extra = tiny_project.write_config("stalling.yaml", STALLING)
    args = [*LM_TRAIN, "run", str(tiny_project.config), str(extra), "--trainer.run_dir", str(run_dir)]
    args += ["--data.validation_urls", "[]", *NO_COMPILE_CACHE]
    logs = tmp_path / "logs"
    with pytest.raises(pytest.fail.Exception) as failed:
        launch(
            args,
            2,
            cwd=tiny_project.root,
            log_dir=logs,
            env=lambda rank: {"LM_TRAIN_TEST_STALL_AT_STEP": "5"} if rank == 1 else {},
            timeout=240,
            grace=40,  # the other process's watchdog fires too, a moment later: let it report and exit
        )
    # Both processes ended themselves with the watchdog's status (neither was killed by the launcher).
    assert "exit code 75 -----" in str(failed.value).split("----- process 0:")[1].split("----- process 1")[0]
    assert str(failed.value).split("----- process 1:")[1].startswith(" exit code 75 -----")
    message = (logs / "stderr-0.txt").read_text(encoding="utf-8")
    assert "lm-train: the watchdog ended the run: no step was done for" in message
    assert "(trainer.watchdog.timeout_s: 8 s)" in message
    assert "Slow: process 1 (busy with its own work at step 5)." in message
    assert "The others: process 0 (waiting for the device at step 6)." in message
    assert "Traceback" not in message
    dumps = sorted(path.name for path in (run_dir / "hangs").iterdir())
    assert dumps == ["process-0-step-6.txt", "process-1-step-5.txt"]
    stalled = (run_dir / "hangs" / "process-1-step-5.txt").read_text(encoding="utf-8")
    assert "--- thread MainThread" in stalled and "time.sleep(24 * 3600)" in stalled
    assert "--- thread lm-train watchdog" in stalled
    waiting = (run_dir / "hangs" / "process-0-step-6.txt").read_text(encoding="utf-8")
    assert "block_until_ready" in waiting
