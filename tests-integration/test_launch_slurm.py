"""`lm-train launch slurm` on a real SLURM cluster of 4 nodes on localhost (the slurm_cluster fixture): a 2-host run
trained to its end; beside it, the same run requeued by `scontrol requeue` after a committed checkpoint, then
stopped by SIGTERM (`scancel --signal=TERM`) and submitted again, resumed each time and ending bitwise equal; and a
2-node launch of 2 tasks per node (4 processes) that loses a node, and restarts on the one left (--min-hosts 1);
and bad input refused before anything is written."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
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


# The test session's LLVM -O0 (conftest.py: half a tiny program's compile), kept where a launch sets its device count.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def launch_env(**extra: str) -> dict[str, str]:
    """2 CPU devices per process: FSDP over the 4 devices of the 2 processes (LM_TRAIN_* reaches every process)."""
    flags = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}", "LM_TRAIN_SKIP_MEMORY_CHECK": "1"}
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


@dataclass
class Launch:
    run_dir: Path
    returncode: int
    output: str


def _start(tiny_project, run_dir: Path, cache: Path, *extra: str, **env: str) -> tuple[subprocess.Popen, Path]:
    """A launch in the background, its console (stdout and stderr) in a file beside its run directory. Its
    restarts load their programs from its own compilation cache, which its first start wrote (a cache of its own:
    the processes of one start never find different programs there, so none reaches the first collective a
    compile later than another)."""
    out = run_dir.parent / f"{run_dir.name}.out"
    args = launch_args(tiny_project, run_dir, cache, "--max-restarts", "2", *extra)
    args[args.index("--trainer.compilation_cache") : args.index("--trainer.compilation_cache") + 2] = [
        "--trainer.compilation_cache_dir",
        str(run_dir.parent / f"{run_dir.name}.xla"),
    ]
    with open(out, "w", encoding="utf-8") as console:
        launcher = subprocess.Popen(
            args,
            cwd=tiny_project.root,
            env=launch_env(**env),
            stdout=console,
            stderr=subprocess.STDOUT,
            text=True,
        )
    return launcher, out


def _committed(run_dir: Path) -> Path | None:
    if not (run_dir / "checkpoints").exists():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)  # a save under way has no marker yet
        return dist_ckpt.latest(run_dir / "checkpoints")


# The shrinking launch: 2 nodes x 2 tasks of 1 CPU device each, the 4 devices of the others; then 1 node x 2 tasks.
SHRINKING = ["--tasks-per-node", "2", "--min-hosts", "1", "--wait-for-hosts", "0"]


@pytest.fixture(scope="module")
def launches(slurm_cluster, tiny_project, cache, tmp_path_factory):
    """Three launches at once on the cluster's 4 nodes. Two of 2 hosts in the default partition: one runs to its
    end; the other is requeued by `scontrol requeue` after its first committed checkpoint, then, once resumed, gets
    SIGTERM. The third, 2 nodes x 2 tasks in the 2-node partition, loses a node (set DOWN) after its first
    checkpoint and goes on on the node left. (At once: the interrupted ones mostly wait, for their slowed steps and
    for SLURM, while the other computes.)"""
    root = tmp_path_factory.mktemp("slurm-launch")
    started = time.monotonic()
    # 1.5 s a step: the node goes after the first checkpoint, well before the end (the math is unchanged).
    shrinking, shrinking_out = _start(
        tiny_project,
        root / "shrinking",
        cache,
        *SHRINKING,
        "--partition",
        slurm_cluster.pair,
        XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}",
        LM_TRAIN_STEP_DELAY_S="1.5",
    )
    launchers, lost_node, job_id, requeued_at, recovery, restart = [shrinking], None, None, None, None, None
    drained, resumed_at = slurm_cluster.nodes[0], None
    try:
        deadline = time.monotonic() + 500
        # Its job first: it fills both CPUs of the pair's 2 nodes, and the others go to the 2 other nodes.
        while not any(r["event"] == "processes" for r in events(root / "shrinking")):
            assert shrinking.poll() is None and time.monotonic() < deadline, shrinking_out.read_text()[-6000:]
            time.sleep(0.2)
        # The queue-wait path: with n1 drained, 1 node of the default partition is free (n3 and n4 are full), and
        # the uninterrupted launch (--min-hosts 2) waits for a second one; n1 is resumed once it waits.
        slurm_cluster.command("scontrol", "update", f"nodename={drained}", "state=drain", "reason=busy")
        whole, whole_out = _start(tiny_project, root / "whole", cache, "--min-hosts", "2", "--wait-for-hosts", "120")
        requeued, requeued_out = _start(tiny_project, root / "requeued", cache, LM_TRAIN_STEP_DELAY_S="1.5")
        launchers += [whole, requeued]
        while "(--wait-for-hosts) for more" not in whole_out.read_text():
            assert whole.poll() is None and time.monotonic() < deadline, whole_out.read_text()[-6000:]
            time.sleep(0.1)
        time.sleep(1)  # it goes on waiting
        slurm_cluster.command("scontrol", "update", f"nodename={drained}", "state=resume")
        resumed_at = time.time()
        # Each interruption as soon as its launch has committed a checkpoint, in whichever order they come.
        while lost_node is None or recovery is None:
            if lost_node is None and _committed(root / "shrinking") is not None:
                lost_node = slurm_cluster.nodes[-1]
                slurm_cluster.command("scontrol", "update", f"nodename={lost_node}", "state=down", "reason=lost")
                continue
            if job_id is None and _committed(root / "requeued") is not None:
                job_id = next(r["job_id"] for r in events(root / "requeued") if r["event"] == "submitted")
                requeued_at = time.monotonic()
                slurm_cluster.command("scontrol", "requeue", job_id)
                continue
            if requeued_at is not None and recovery is None:
                restart = restart or _restarted(root / "requeued")
                if restart is not None and _stepped_after(root / "requeued", *restart):
                    recovery = time.monotonic() - requeued_at
                    # Then SIGTERM to its processes, as a preemption notice: they save and exit 143, the job ends
                    # FAILED and the launcher submits it again.
                    slurm_cluster.command("scancel", "--signal=TERM", job_id)
            waiting = [(shrinking, shrinking_out)] * (lost_node is None) + [(requeued, requeued_out)] * (
                recovery is None
            )
            for launcher, out in waiting:
                assert launcher.poll() is None and time.monotonic() < deadline, out.read_text()[-6000:]
            time.sleep(0.1)
        whole.wait(timeout=500)
        requeued.wait(timeout=500)
        shrinking.wait(timeout=500)
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
        if lost_node is not None:  # back, for the tests that count the cluster's nodes
            slurm_cluster.command("scontrol", "update", f"nodename={lost_node}", "state=resume")
        if resumed_at is None:
            slurm_cluster.command("scontrol", "update", f"nodename={drained}", "state=resume", check=False)
    print(f"\nslurm launch: the three launches in {time.monotonic() - started:.1f} s; from `scontrol requeue` to the")
    print(f"first step after the restart: {recovery:.1f} s; launch.jsonl:")
    print((root / "requeued" / "launch.jsonl").read_text())
    print(f"the launch that lost {lost_node}:\n{(root / 'shrinking' / 'launch.jsonl').read_text()}")
    return {
        "whole": Launch(root / "whole", whole.returncode, whole_out.read_text()),
        "requeued": Launch(root / "requeued", requeued.returncode, requeued_out.read_text()),
        "shrinking": Launch(root / "shrinking", shrinking.returncode, shrinking_out.read_text()),
        "job_id": job_id,
        "lost_node": lost_node,
        "resumed_at": resumed_at,
    }


def test_a_two_host_launch_trains_to_the_end_with_one_process_per_node(launches, slurm_cluster):
    run_dir, status, output = dataclasses.astuple(launches["whole"])
    assert status == 0, output[-8000:] + slurm_cluster.log()
    rows = events(run_dir)
    assert [r["event"] for r in rows] == ["start", "submitted", "processes", "finished"]
    # It waited (--min-hosts) while 1 node was free, and started once the drained node was back.
    assert "launch: the slurm cluster has 1 host(s) free, fewer than --hosts 2: waiting up to 120 s" in output
    assert rows[0]["waited_for_hosts_s"] > 1 and rows[0]["hosts"] == 2
    assert datetime.fromisoformat(rows[0]["time"]).timestamp() >= launches["resumed_at"]
    assert re.fullmatch(r"n\[[1-4][-,][1-4]\]", rows[2]["nodes"]) and rows[2]["restarts"] == 0
    assert "distributed: 2 processes, 4 cpu devices" in output  # process 0's console, streamed
    assert "resuming from" not in output
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
    config = (run_dir / "config.yaml").read_text(encoding="utf-8")
    assert f"id: {run_id}" in config and "backend: slurm" in config
    # Each process recorded its exit status, 0.
    assert [(script.parent / f"status-{i}").read_text().strip() for i in range(2)] == ["0", "0"]


def test_a_requeued_job_resumes_and_ends_bitwise_equal(launches, slurm_cluster):
    run_dir, status, output = dataclasses.astuple(launches["requeued"])
    assert status == 0, output[-8000:] + slurm_cluster.log()
    job_id = launches["job_id"]
    rows = events(run_dir)
    kinds = [r["event"] for r in rows]
    assert kinds[:7] == ["start", "submitted", "processes", "failed", "restart", "processes", "failed"], kinds
    assert kinds[7:] == ["restart", "submitted", "processes", "finished"], kinds
    assert rows[3]["cause"].startswith(f"SLURM requeued job {job_id} (restart 1")
    assert rows[4]["cause"] == rows[3]["cause"]
    assert rows[5]["job_id"] == job_id and rows[5]["restarts"] == 1  # the same job, run again by SLURM
    # SIGTERM: each process saved and exited 128 + 15; the job ended and a new one was submitted.
    assert rows[6]["exit_status"] == 143 and rows[6]["cause"] == (
        f"SLURM job {job_id} ended FAILED (process exit statuses {{0: 143, 1: 143}})"
    )
    assert rows[8]["job_id"] != job_id and rows[9]["restarts"] == 0
    assert output.count("resuming from") == 2 and "launch: restarting run" in output
    reference, resumed = final_params(launches["whole"].run_dir), final_params(run_dir)
    assert reference.keys() == resumed.keys() and len(reference) > 4
    for key, value in reference.items():
        assert value.dtype == resumed[key].dtype and np.array_equal(value, resumed[key]), key


def test_a_lost_node_restarts_the_run_on_the_node_left_with_two_processes_per_node(launches, slurm_cluster):
    run_dir, status, output = dataclasses.astuple(launches["shrinking"])
    assert status == 0, output[-8000:] + slurm_cluster.log()
    rows = events(run_dir)
    kinds = [r["event"] for r in rows]
    assert kinds[:3] == ["start", "submitted", "processes"] and kinds[-1] == "finished", kinds
    assert rows[2]["nodes"] == f"n[{len(slurm_cluster.nodes) - 1}-{len(slurm_cluster.nodes)}]"
    first_job = rows[1]["job_id"]
    # SLURM requeued the job when its node went DOWN; the launcher restarted on the 1 node left (--min-hosts 1):
    # the requeued job, which waited for 2 nodes, was cancelled and a job of 1 node submitted.
    assert kinds[3:] == ["failed", "restart", "resized", "submitted", "processes", "finished"], kinds
    assert f"job {first_job}" in rows[3]["cause"] and rows[4]["hosts"] == 1
    assert rows[5]["job_id"] == first_job and (rows[5]["hosts_before"], rows[5]["hosts"]) == (2, 1)
    assert rows[6]["job_id"] != first_job and rows[7]["nodes"] == slurm_cluster.nodes[-2]
    # 2 tasks a node, numbered node by node; each process's local index from SLURM_LOCALID.
    first, second = (Path(rows[i]["script"]).read_text(encoding="utf-8") for i in (1, 6))
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in first and "#SBATCH --nodes=1\n" in second
    assert "--ntasks-per-node=2 " in first and "--distribution=block" in first
    assert 'LM_TRAIN_LOCAL_PROCESS_ID="$SLURM_LOCALID"' in first and "LM_TRAIN_LOCAL_PROCESS_COUNT=2" in first
    assert "distributed: 4 processes, 4 cpu devices" in output and "distributed: 2 processes, 2 cpu devices" in output
    assert output.count("resuming from") == 1
    job_dir = Path(rows[6]["script"]).parent
    assert [(job_dir / f"status-{i}").read_text().strip() for i in range(2)] == ["0", "0"]
    # The 4 processes of 1 device compute what the 2 of 2 devices of the uninterrupted launch do (4 devices, one
    # mesh); after the restart on 2 devices the sums run in another order, and the losses go on as its do.
    whole = trackers.read_jsonl(launches["whole"].run_dir / "metrics.jsonl")
    reference = {r["step"]: r["train/loss"] for r in whole if "train/loss" in r}
    losses = {r["step"]: r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1))
    resumed_from = int(re.search(r"resuming from .*step-(\d+)", output).group(1))
    for step, loss in losses.items():
        if step <= resumed_from:
            assert loss == reference[step], (step, loss, reference[step])
        else:
            assert abs(loss - reference[step]) < 1e-5, (step, loss, reference[step])


def _restarted(run_dir: Path) -> tuple[int, bytes] | None:
    """Once the restarted start has begun: the checkpoint it resumes from (the newest committed before it began)
    and the metrics then (it rewrites the rows past that checkpoint)."""
    if len([r for r in events(run_dir) if r["event"] == "processes"]) < 2:
        return None
    return int(_committed(run_dir).name.split("-")[1]), (run_dir / "metrics.jsonl").read_bytes()


def _stepped_after(run_dir: Path, resumed_from: int, before: bytes) -> bool:
    """Whether the restarted start has logged its first step."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.read_bytes() == before:
        return False
    rows = [r for r in trackers.read_jsonl(metrics) if "train/loss" in r]
    return bool(rows) and rows[-1]["step"] > resumed_from


def test_no_such_partition_and_too_many_hosts_are_refused_before_anything_is_written(
    slurm_cluster, tiny_project, cache, tmp_path
):
    run_dir = tmp_path / "run"
    # The last: --min-hosts 2 in the 2-node partition with one node drained gives up after --wait-for-hosts.
    waits = ["--partition", "pair", "--min-hosts", "2", "--wait-for-hosts", "1"]
    for extra, expected in (
        (["--partition", "gpu"], "error: SLURM has no partition 'gpu' (--partition); its partitions are: debug, pair."),
        (["--hosts", "5"], "error: The slurm cluster has 4 nodes alive, fewer than --hosts 5 (one training process"),
        (waits, "error: The slurm cluster had 1 host(s) free after waiting 1 s (--wait-for-hosts), fewer than "),
    ):
        if extra is waits:
            slurm_cluster.command(
                "scontrol", "update", f"nodename={slurm_cluster.nodes[-1]}", "state=drain", "reason=x"
            )
        try:
            done = subprocess.run(
                [*launch_args(tiny_project, run_dir, cache), *extra],
                cwd=tiny_project.root,
                env=launch_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            if extra is waits:
                slurm_cluster.command("scontrol", "update", f"nodename={slurm_cluster.nodes[-1]}", "state=resume")
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].startswith(expected), done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        assert not run_dir.exists()


def test_a_second_launch_of_a_run_whose_job_is_still_queued_is_refused(slurm_cluster, tiny_project, cache, tmp_path):
    # A job of the run, as a launcher that was killed leaves it (held: it stays queued, and holds no node).
    name = "lm-train-held-run"
    job_id = slurm_cluster.command("sbatch", "--parsable", "--hold", f"--job-name={name}", "--wrap", "sleep 60")
    job_id = job_id.strip().split(";")[0]
    try:
        args = [*launch_args(tiny_project, tmp_path / "run", cache), "--trainer.id", "held-run"]
        done = subprocess.run(args, cwd=tiny_project.root, env=launch_env(), capture_output=True, text=True)
    finally:
        slurm_cluster.command("scancel", job_id)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: Run held-run already has SLURM job {job_id} (PENDING) queued or running (`squeue -n {name}`). Wait "
        f"for it to end, or cancel it (`scancel {job_id}`), then launch again: it resumes from the newest intact "
        "checkpoint."
    )
    assert not (tmp_path / "run").exists()
