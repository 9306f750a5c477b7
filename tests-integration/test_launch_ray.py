"""`lm-train launch ray` on a real Ray cluster of 3 nodes on localhost (ray.cluster_utils.Cluster, 1 CPU each):
a 2-host run with FSDP across its 2 processes; the same run with one of its nodes removed after a committed
checkpoint, restarted on the 2 nodes left and ending bitwise equal; a --min-hosts launch that waits for a node to
join (last: the node it adds stays); and the errors that need a cluster."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
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
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
STEPS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head and two worker nodes of 1 CPU each; this test process starts them and never joins as a driver."""
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)  # read by `import ray` and by the nodes it starts
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 96 * 2**20}
    ray_cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    for _ in range(2):
        ray_cluster.add_node(**node)
    yield ray_cluster
    ray_cluster.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def launch_args(tiny_project, run_dir: Path, cache: Path, address: str, *extra: str) -> list[str]:
    args = [*LM_TRAIN, "launch", "ray", str(tiny_project.config), "--address", address, "--hosts", "2"]
    args += ["--heartbeat-timeout", "20", *extra, "--trainer.run_dir", str(run_dir)]
    args += ["--trainer.num_train_steps", str(STEPS), "--trainer.log_every", "1", "--data.cache_dir", str(cache)]
    # Without the persistent compilation cache: where process 0 loaded the step from it while process 1 compiled,
    # process 1 came to the first collective more than the 30 s that gloo waits (in XLA) later, on a loaded machine.
    return [*args, "--data.validation_urls", "[]", "--trainer.compilation_cache", "false"]


# The test session's LLVM -O0 (conftest.py: half a tiny program's compile), kept where a launch sets its device count.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def launch_env(**extra: str) -> dict[str, str]:
    """2 CPU devices per process: FSDP over the 4 devices of the 2 processes. The memory check's trace is skipped
    (an LM_TRAIN_* variable, which the launch passes to every process)."""
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
def uninterrupted(cluster, tiny_project, tmp_path_factory):
    """A 2-host launch that runs to its end; it builds the cache, on the cluster, for the other launches."""
    run_dir = tmp_path_factory.mktemp("launch") / "whole"
    cache = tmp_path_factory.mktemp("launch-cache")
    # A first collective waits 30 s at most for the other process (gloo, in XLA): on a loaded machine process 0,
    # which also builds the cache, may compile that much later, and the launch then starts the job again (the
    # compile cache is warm by then). A start that failed before the first checkpoint trains from step 0: the run
    # is still uninterrupted, which the test checks.
    args = launch_args(tiny_project, run_dir, cache, cluster.address, "--max-restarts", "3")
    done = subprocess.run(args, cwd=tiny_project.root, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert "resuming from" not in done.stdout + done.stderr
    return run_dir, cache, done


def test_a_two_host_launch_trains_with_one_process_per_node(uninterrupted):
    run_dir, _, done = uninterrupted
    rows = events(run_dir)
    kinds = [r["event"] for r in rows]
    assert kinds[:2] == ["start", "processes"] and kinds[-1] == "finished"
    assert kinds[2:-1] == ["failed", "restart", "processes"] * ((len(kinds) - 3) // 3), kinds
    processes = rows[-2]["processes"]
    assert [p["process"] for p in processes] == [0, 1]
    assert len({p["node_id"] for p in processes}) == 2  # STRICT_SPREAD: two nodes
    assert "distributed: 2 processes, 4 cpu devices" in done.stdout  # process 0's console, streamed
    losses = {r["step"]: r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    # The shipped code is this checkout at its commit, with its uncommitted changes named and hashed.
    root = Path(__file__).parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    status = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True).stdout
    config = (run_dir / "config.yaml").read_text(encoding="utf-8")
    assert f"commit: {head.strip()}" in config
    assert rows[0]["commit"] == head.strip()
    assert (rows[0]["diff_sha256"] is None) == (status.strip() == "")
    assert Path(rows[-2]["workdir"]).name != root.name  # Ray's unpacked working_dir, not this checkout
    # The run id was generated once and kept in the run directory.
    run_id = (run_dir / "run-id").read_text(encoding="utf-8").strip()
    assert run_id.startswith("tiny-") and rows[0]["run_id"] == run_id and f"id: {run_id}" in config


def test_a_lost_node_restarts_the_run_on_the_nodes_left_and_ends_bitwise_equal(
    cluster, uninterrupted, tiny_project, tmp_path_factory
):
    whole, cache, _ = uninterrupted
    run_dir = tmp_path_factory.mktemp("launch") / "interrupted"
    args = launch_args(tiny_project, run_dir, cache, cluster.address, "--max-restarts", "3")
    # 1.5 s a step: the node goes after the first checkpoint, well before the end (the math is unchanged).
    env = launch_env(LM_TRAIN_STEP_DELAY_S="1.5")
    launcher = subprocess.Popen(
        args, cwd=tiny_project.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        victim, recovery, busy = _remove_a_node_after_a_checkpoint(cluster, run_dir, launcher)
        output, _ = launcher.communicate(timeout=900)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-8000:]
    rows = events(run_dir)
    kinds = [r["event"] for r in rows]
    assert kinds[:2] == ["start", "processes"] and kinds[-1] == "finished"
    assert kinds[2:-1] == ["failed", "restart", "processes"] * ((len(kinds) - 3) // 3) and len(kinds) > 3, kinds
    lost_at = max(i for i, r in enumerate(rows) if r["event"] == "processes" and victim in _nodes(r)) + 1
    assert rows[lost_at]["event"] == "failed" and rows[lost_at + 1]["cause"] == rows[lost_at]["cause"]
    assert rows[lost_at + 1]["hosts"] == 2 and victim not in _nodes(rows[lost_at + 2])  # the 2 nodes left
    assert "launch: restarting run" in output and "resuming from" in output
    reference, resumed = final_params(whole), final_params(run_dir)
    assert reference.keys() == resumed.keys() and len(reference) > 4
    for key, value in reference.items():
        assert value.dtype == resumed[key].dtype and np.array_equal(value, resumed[key]), key
    # The launcher blocks on its hosts' answers while the run trains (it polled in a loop at half a CPU before).
    assert busy < 0.1, f"the launcher used {busy:.0%} of a CPU while the run trained"
    print(f"\nlaunch: the launcher's CPU use while the run trained: {busy:.1%}")
    print(f"launch: from the node's removal to the first step after the restart: {recovery:.1f} s")
    print(f"launch.jsonl:\n{(run_dir / 'launch.jsonl').read_text()}")


def _committed(run_dir: Path) -> Path | None:
    """The newest committed checkpoint of the run, or None (one being written is not)."""
    if not (run_dir / "checkpoints").exists():
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)  # a save under way has no marker yet
        return dist_ckpt.latest(run_dir / "checkpoints")


def _nodes(row: dict) -> set[str]:
    return {p["node_id"] for p in row["processes"]}


def _remove_a_node_after_a_checkpoint(cluster, run_dir: Path, launcher: subprocess.Popen) -> tuple[str, float, float]:
    """Remove the node of a process that is not on the head, once a checkpoint is committed, and kill its
    training process with it; that node's id, the seconds from then to the first step logged after the restart,
    and the launcher's CPU use (a share of one CPU) from its processes' start to the checkpoint."""
    import psutil

    deadline = time.monotonic() + 600
    while not any(r["event"] == "processes" for r in events(run_dir)):
        if launcher.poll() is not None:  # what the launcher said is the cause
            raise AssertionError(f"no processes before the launch ended:\n{launcher.stdout.read()[-6000:]}")
        assert time.monotonic() < deadline, "no processes within 600 s"
        time.sleep(0.2)
    watched, cpu_before = time.monotonic(), sum(psutil.Process(launcher.pid).cpu_times()[:2])
    while _committed(run_dir) is None:
        assert launcher.poll() is None and time.monotonic() < deadline, "no checkpoint before the launch ended"
        time.sleep(0.2)
    busy = (sum(psutil.Process(launcher.pid).cpu_times()[:2]) - cpu_before) / (time.monotonic() - watched)
    started = [r for r in events(run_dir) if r["event"] == "processes"][-1]
    head = cluster.head_node.node_id
    victim = next(p for p in started["processes"] if p["node_id"] != head)
    node = next(n for n in cluster.worker_nodes if n.node_id == victim["node_id"])
    removed = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    with contextlib.suppress(ProcessLookupError):  # a lost host's processes die with it
        os.kill(victim["pid"], signal.SIGKILL)
    while not any(r["event"] == "processes" and r["attempt"] > started["attempt"] for r in events(run_dir)):
        assert launcher.poll() is None and time.monotonic() < deadline, "no restart"
        time.sleep(0.2)
    resumed_from = int(_committed(run_dir).name.split("-")[1])
    metrics = run_dir / "metrics.jsonl"
    before = metrics.read_bytes()
    while True:  # the restarted run rewrites the rows past its checkpoint, then logs its first step
        now = metrics.read_bytes()
        rows = [r for r in trackers.read_jsonl(metrics) if "train/loss" in r] if now != before else []
        if rows and rows[-1]["step"] > resumed_from:
            return victim["node_id"], time.monotonic() - removed, busy
        assert launcher.poll() is None and time.monotonic() < deadline, "no step after the restart"
        time.sleep(0.1)


def test_fewer_nodes_than_hosts_is_refused_before_anything_is_written(cluster, tiny_project, tmp_path):
    run_dir = tmp_path / "run"
    args = launch_args(tiny_project, run_dir, tmp_path / "cache", cluster.address)
    args[args.index("--hosts") + 1] = "5"
    done = subprocess.run(args, cwd=tiny_project.root, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.search(r"has [23] nodes alive, fewer than --hosts 5\b", done.stderr), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not run_dir.exists()


def test_exhausted_restarts_are_one_paragraph_and_leave_the_checkpoints_as_they_were(
    cluster, uninterrupted, tiny_project
):
    whole, cache, _ = uninterrupted
    before = {p.name: p.stat().st_mtime_ns for p in (whole / "checkpoints").iterdir()}
    args = launch_args(tiny_project, whole, cache, cluster.address, "--max-restarts", "1")
    # XLA aborts at start-up on a flag it does not know: a crash that no restart can get past.
    env = launch_env(XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_no_such_flag_for_a_test")
    done = subprocess.run(args, cwd=tiny_project.root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("error: Run tiny-") and "failed 2 time(s), --max-restarts 1 being spent" in message
    assert "launch.jsonl" in message and "run the same `lm-train launch` command again" in message
    assert "Traceback" not in done.stderr
    assert [r["event"] for r in events(whole)][-5:] == ["failed", "restart", "processes", "failed", "gave_up"]
    assert {p.name: p.stat().st_mtime_ns for p in (whole / "checkpoints").iterdir()} == before


# A stand-in for `lm-train run` (the Ray cluster, actors and launcher are the real ones): on its first start process 1
# exits with the watchdog's status, 75 (once process 0 has started: the launcher stops it at once); on the second
# process 0 finishes at once and process 1 hangs.
STAND_IN = """
import os, pathlib, sys, time
index = int(os.environ["LM_TRAIN_PROCESS_ID"])
marker = pathlib.Path(sys.argv[1]) / f"started-{index}"
first = not marker.exists()
marker.touch()
if first and index == 1:
    while not marker.with_name("started-0").exists():
        time.sleep(0.05)
    sys.exit(75)
sys.exit(0) if index == 0 and not first else time.sleep(600)
"""


def test_the_watchdogs_exit_is_restarted_and_a_process_left_hanging_after_process_0_is_stopped(
    cluster, tmp_path, capsys
):
    from dataclasses import dataclass

    from lm_train.config.schema import LaunchRecord
    from lm_train.launch.prepared import PreparedLaunch
    from lm_train.launch.ray_backend import RayBackend
    from lm_train.launch.supervise import supervise

    @dataclass(frozen=True)
    class StandIn(PreparedLaunch):
        def argv(self, python: str, workdir: str) -> list[str]:
            return [python, "-c", STAND_IN, str(tmp_path)]

    (tmp_path / "ship").mkdir()
    prepared = StandIn("stand-in", tmp_path / "run", tmp_path / "ship", (), {}, str(tmp_path), LaunchRecord("ray"))
    backend = RayBackend(cluster.address, heartbeat_timeout_s=20, finish_wait_s=3)
    backend.connect(prepared)
    try:
        started = time.monotonic()
        assert supervise(prepared, backend, hosts=2, min_hosts=2, max_restarts=1) == 0
        took = time.monotonic() - started
    finally:
        backend.close()
    rows = events(tmp_path / "run")
    kinds = [r["event"] for r in rows]
    assert kinds == ["start", "processes", "failed", "restart", "processes", "stragglers_stopped", "finished"], kinds
    assert rows[2]["exit_status"] == 75 and "host 1" in rows[2]["cause"] and "exited with status 75" in rows[2]["cause"]
    assert rows[5]["processes"] == [1]
    assert "launch: process 0 finished, but process(es) [1] had not exited 3 s later: stopping them" in (
        capsys.readouterr().err
    )
    assert took < 120  # 3 s of grace, then the stop: not the 600 s the stand-in would hang


# A stand-in for `lm-train run` that records what the launcher handed it, and exits.
RECORDS = """
import json, os, pathlib, sys
names = ("PROCESS_ID", "NUM_PROCESSES", "LOCAL_PROCESS_ID", "LOCAL_PROCESS_COUNT")
ids = {name: int(os.environ["LM_TRAIN_" + name]) for name in names}
pathlib.Path(sys.argv[1], f"process-{ids['PROCESS_ID']}.json").write_text(json.dumps(ids))
"""


def test_two_tasks_per_node_are_numbered_node_by_node_with_their_local_index(cluster, tmp_path):
    from dataclasses import dataclass

    from lm_train.config.schema import LaunchRecord
    from lm_train.launch.prepared import PreparedLaunch
    from lm_train.launch.ray_backend import RayBackend
    from lm_train.launch.supervise import supervise

    @dataclass(frozen=True)
    class StandIn(PreparedLaunch):
        def argv(self, python: str, workdir: str) -> list[str]:
            return [python, "-c", RECORDS, str(tmp_path)]

    (tmp_path / "ship").mkdir()
    prepared = StandIn("tasks", tmp_path / "run", tmp_path / "ship", (), {}, str(tmp_path), LaunchRecord("ray"))
    backend = RayBackend(cluster.address, heartbeat_timeout_s=20, finish_wait_s=3, tasks_per_node=2)
    backend.connect(prepared)
    try:
        assert supervise(prepared, backend, hosts=2, min_hosts=2, max_restarts=0) == 0
    finally:
        backend.close()
    processes = next(r for r in events(tmp_path / "run") if r["event"] == "processes")["processes"]
    nodes = [p["node_id"] for p in processes]
    assert [p["process"] for p in processes] == [0, 1, 2, 3]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # 2 nodes, 2 processes on each, node by node
    handed = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(4)]
    assert handed == [
        {"PROCESS_ID": i, "NUM_PROCESSES": 4, "LOCAL_PROCESS_ID": i % 2, "LOCAL_PROCESS_COUNT": 2} for i in range(4)
    ]


def test_a_launch_with_min_hosts_waits_for_a_node_to_join_or_gives_up(cluster, tmp_path, capsys):
    """--min-hosts above the nodes alive: the first start gives up after --wait-for-hosts with one paragraph and
    nothing written, or starts on every host once a node joins the cluster (cluster.add_node) within the wait."""
    import threading
    from dataclasses import dataclass

    import ray

    from lm_train.config.schema import LaunchRecord
    from lm_train.launch.prepared import PreparedLaunch
    from lm_train.launch.ray_backend import RayBackend
    from lm_train.launch.snapshot import LaunchError
    from lm_train.launch.supervise import supervise

    @dataclass(frozen=True)
    class StandIn(PreparedLaunch):
        def argv(self, python: str, workdir: str) -> list[str]:
            return [python, "-c", RECORDS, str(tmp_path)]

    (tmp_path / "ship").mkdir()
    prepared = StandIn("waits", tmp_path / "run", tmp_path / "ship", (), {}, str(tmp_path), LaunchRecord("ray"))
    # A node that has just joined started its first worker (with the job's runtime_env) only after the raylet's 60 s
    # registration timeout, in two runs of this file out of three: the launch's 60 s to start its actors was too short.
    backend = RayBackend(cluster.address, heartbeat_timeout_s=20, finish_wait_s=3, placement_timeout_s=180)
    backend.connect(prepared)
    try:
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        wanted = alive + 1
        started = time.monotonic()
        with pytest.raises(LaunchError) as refused:
            supervise(
                prepared,
                backend,
                hosts=wanted,
                min_hosts=wanted,
                max_restarts=0,
                wait_for_hosts_s=1,
                wait_at_start=True,
            )
        assert time.monotonic() - started < 10
        assert str(refused.value) == (
            f"The ray cluster had {alive} host(s) free after waiting 1 s (--wait-for-hosts), fewer than --min-hosts "
            f"{wanted}: nothing was started. Free or add nodes (`sinfo` or `ray status` shows what holds them), or "
            "lower --min-hosts, or wait longer with --wait-for-hosts; then launch again."
        )
        assert not (tmp_path / "run").exists()
        # The second launch waits in a thread while a node joins (Ray starts a node from the main thread only).
        outcome: dict[str, object] = {}

        def launch() -> None:
            try:
                outcome["status"] = supervise(
                    prepared,
                    backend,
                    hosts=wanted,
                    min_hosts=wanted,
                    max_restarts=0,
                    wait_for_hosts_s=60,
                    wait_at_start=True,
                )
            except BaseException as e:  # the test's assertion shows it
                outcome["status"] = e

        waiting = threading.Thread(target=launch)
        waiting.start()
        cluster.add_node(num_cpus=1, object_store_memory=96 * 2**20)
        waiting.join(timeout=300)  # beyond the actors' 180 s start: a late worker is slow, not lost
        assert outcome.get("status") == 0, outcome
    finally:
        backend.close()
    err = capsys.readouterr().err
    assert err.count(f"launch: the ray cluster has {alive} host(s) free, fewer than --hosts {wanted}: waiting") == 2
    rows = events(tmp_path / "run")
    assert [r["event"] for r in rows] == ["start", "processes", "finished"]
    assert rows[0]["hosts"] == wanted and 0 < rows[0]["waited_for_hosts_s"] < 60
    assert len({p["node_id"] for p in rows[1]["processes"]}) == wanted  # the new node runs one of them
    handed = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(wanted)]
    assert [h["NUM_PROCESSES"] for h in handed] == [wanted] * wanted
