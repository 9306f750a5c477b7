"""`lm-train launch slurm` on a real SLURM cluster of 2 nodes on localhost (the slurm_cluster fixture): a 2-host run
trained to its end; the same run requeued by `scontrol requeue` after a committed checkpoint, resumed and ending
bitwise equal; and bad input refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import dist_ckpt
import trackers

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LM_TRAIN = [sys.executable, "-m", "lm_train"]
STEPS = 8


def launch_args(tiny_project, run_dir: Path, cache: Path, *extra: str) -> list[str]:
    args = [*LM_TRAIN, "launch", "slurm", str(tiny_project.config), "--hosts", "2", *extra]
    args += ["--trainer.run_dir", str(run_dir), "--trainer.num_train_steps", str(STEPS), "--trainer.log_every", "1"]
    args += ["--data.cache_dir", str(cache), "--data.validation_urls", "[]"]
    return [*args, "--trainer.compilation_cache", "false"]


def launch_env(**extra: str) -> dict[str, str]:
    """2 CPU devices per process: FSDP over the 4 devices of the 2 processes (LM_TRAIN_* reaches every process)."""
    flags = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "LM_TRAIN_SKIP_MEMORY_CHECK": "1"}
    return {**os.environ, **flags, "JAX_PLATFORMS": "cpu", **extra}


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "launch.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def final_params(run_dir: Path) -> dict[str, np.ndarray]:
    """The last checkpoint's model, read with dist_ckpt's plain reader (numpy arrays by key path)."""
    flat = dist_ckpt.load(run_dir / "checkpoints" / f"step-{STEPS}", progress=False)
    return {k: v for k, v in flat.items() if k.startswith(".model")}


@pytest.fixture(scope="module")
def cache(tiny_project, tmp_path_factory):
    """The corpus's cache, built once ahead: a run whose cache is built starts no Ray on the SLURM nodes."""
    cache = tmp_path_factory.mktemp("slurm-cache")
    args = [*LM_TRAIN, "cache", str(tiny_project.config), "--data.cache_dir", str(cache)]
    done = subprocess.run(
        [*args, "--data.validation_urls", "[]"], cwd=tiny_project.root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return cache


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tiny_project, cache, tmp_path_factory):
    """A 2-host launch that runs to its end."""
    run_dir = tmp_path_factory.mktemp("slurm-launch") / "whole"
    started = time.perf_counter()
    done = subprocess.run(
        launch_args(tiny_project, run_dir, cache),
        cwd=tiny_project.root,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:] + slurm_cluster.log()
    print(f"\nslurm launch: an 8-step 2-host run in {time.perf_counter() - started:.1f} s")
    return run_dir, done


def test_a_two_host_launch_trains_to_the_end_with_one_process_per_node(uninterrupted, slurm_cluster):
    run_dir, done = uninterrupted
    rows = events(run_dir)
    assert [r["event"] for r in rows] == ["start", "submitted", "processes", "finished"]
    assert rows[2]["nodes"] == "n[1-2]" and rows[2]["restarts"] == 0
    assert "distributed: 2 processes, 4 cpu devices" in done.stdout  # process 0's console, streamed
    assert "resuming from" not in done.stdout + done.stderr
    losses = {r["step"]: r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    # The shipped code and the script lie in the run directory, on the file system every node shares.
    script = Path(rows[1]["script"])
    assert script.parent.parent == run_dir / "slurm" and (script.parent / "code" / "lm-train-launch").is_dir()
    text = script.read_text(encoding="utf-8")
    assert "#SBATCH --nodes=2" in text and "#SBATCH --requeue" in text and "srun --nodes=2" in text
    # The run id was generated once, kept in the run directory and in the shipped config.
    run_id = (run_dir / "run-id").read_text(encoding="utf-8").strip()
    assert run_id.startswith("tiny-") and rows[0]["run_id"] == run_id
    assert f"id: {run_id}" in (run_dir / "config.yaml").read_text(encoding="utf-8")
    assert "backend: slurm" in (run_dir / "config.yaml").read_text(encoding="utf-8")
    # The job is over, and each process recorded its exit status 0.
    assert sorted(p.name for p in script.parent.glob("status-*")) == ["status-0", "status-1"]
    assert slurm_cluster.idle_nodes() == 2


def _committed(run_dir: Path) -> Path | None:
    if not (run_dir / "checkpoints").exists():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)  # a save under way has no marker yet
        return dist_ckpt.latest(run_dir / "checkpoints")


def test_a_requeued_job_resumes_and_ends_bitwise_equal(slurm_cluster, uninterrupted, tiny_project, cache, tmp_path):
    whole, _ = uninterrupted
    run_dir = tmp_path / "requeued"
    # 1.5 s a step: the requeue comes after the first checkpoint, well before the end (the math is unchanged).
    launcher = subprocess.Popen(
        launch_args(tiny_project, run_dir, cache, "--max-restarts", "2"),
        cwd=tiny_project.root,
        env=launch_env(LM_TRAIN_STEP_DELAY_S="1.5"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 400
        while _committed(run_dir) is None:
            assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint before the launch ended"
            time.sleep(0.2)
        job_id = next(r["job_id"] for r in events(run_dir) if r["event"] == "submitted")
        slurm_cluster.command("scontrol", "requeue", job_id)
        output, _ = launcher.communicate(timeout=400)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-8000:] + slurm_cluster.log()
    rows = events(run_dir)
    kinds = [r["event"] for r in rows]
    assert kinds == ["start", "submitted", "processes", "failed", "restart", "processes", "finished"], kinds
    assert rows[3]["cause"].startswith(f"SLURM requeued job {job_id} (restart 1")
    assert rows[4]["cause"] == rows[3]["cause"]
    assert rows[5]["job_id"] == job_id and rows[5]["restarts"] == 1  # the same job, run again by SLURM
    assert "launch: restarting run" in output and "resuming from" in output
    reference, resumed = final_params(whole), final_params(run_dir)
    assert reference.keys() == resumed.keys() and len(reference) > 4
    for key, value in reference.items():
        assert value.dtype == resumed[key].dtype and np.array_equal(value, resumed[key]), key


def test_no_such_partition_and_too_many_hosts_are_refused_before_anything_is_written(
    slurm_cluster, tiny_project, cache, tmp_path
):
    run_dir = tmp_path / "run"
    for extra, expected in (
        (["--partition", "gpu"], "error: SLURM has no partition 'gpu' (--partition); its partitions are: debug."),
        (["--hosts", "3"], "error: The slurm cluster has 2 nodes alive, fewer than --hosts 3 (one training process"),
    ):
        done = subprocess.run(
            [*launch_args(tiny_project, run_dir, cache), *extra],
            cwd=tiny_project.root,
            env=launch_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].startswith(expected), done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        assert not run_dir.exists()
