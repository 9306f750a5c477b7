"""Several processes on localhost in one jax.distributed run (gloo CPU collectives): the launcher itself, each
process reading only its slice of every global batch, and the real CLI trained by 2 processes x 4 devices, which
checkpoints, gives the loss curve of 1 process x 8 devices, and is resumed by a single process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dist_ckpt
import trackers
from conftest import xla_flags

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LM_TRAIN = [sys.executable, "-m", "lm_train"]


def write_script(directory: Path, name: str, code: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    return path


# -- the launcher -------------------------------------------------------------------------------------------


def test_launcher_collects_every_result(tmp_path, launch):
    script = write_script(
        tmp_path,
        "hello.py",
        """
        import json, os
        import numpy as np
        from jax.experimental import multihost_utils
        from lm_train.run.distributed import initialize_distributed
        import jax

        info = initialize_distributed()
        ranks = multihost_utils.process_allgather(np.asarray(info.process_index))  # a real gloo collective
        with open(os.environ["MP_RESULT_FILE"], "w") as f:
            json.dump({"index": info.process_index, "count": info.process_count, "mode": info.mode,
                       "global_devices": jax.device_count(), "local_devices": jax.local_device_count(),
                       "ranks": ranks.tolist()}, f)
        print("hello from", info.process_index)
        """,
    )
    results = launch([sys.executable, str(script)], 2, cwd=tmp_path, log_dir=tmp_path / "logs", timeout=120)
    assert [r.returncode for r in results] == [0, 0]
    for rank, r in enumerate(results):
        assert r.result["index"] == rank and r.result["count"] == 2
        assert r.result["global_devices"] == 8 and r.result["local_devices"] == 4
        assert r.result["ranks"] == [0, 1]
        assert r.result["mode"].startswith("explicit: coordinator 127.0.0.1:")
        assert f"hello from {rank}" in r.stdout


def test_jax_distributed_is_shut_down_before_jax_clears_its_backends_at_exit(tmp_path, launch):
    # jax's exit hook (registered when jax is imported) clears the backends, then shuts jax.distributed down; a
    # hook registered between the two finds which order the processes leave in. Process 0 once hung at exit.
    script = write_script(
        tmp_path,
        "exit_order.py",
        """
        import atexit, json, os
        import jax

        def record():
            with open(os.environ["MP_RESULT_FILE"], "w") as f:
                json.dump({"distributed_at_exit": jax.distributed.is_initialized()}, f)

        atexit.register(record)  # after jax's hook, before lm_train's: it runs between them
        from lm_train.run.distributed import initialize_distributed
        initialize_distributed()
        """,
    )
    results = launch([sys.executable, str(script)], 2, cwd=tmp_path, log_dir=tmp_path / "logs", timeout=120)
    assert [r.result for r in results] == [{"distributed_at_exit": False}] * 2


def test_launcher_fails_loudly_with_every_process_output(tmp_path, launch):
    # Process 1 fails at once; process 0 would wait forever: it is killed, and both outputs are reported.
    code = """
        import os, sys, time
        rank = int(os.environ["LM_TRAIN_PROCESS_ID"])
        print(f"stderr of process {rank}", file=sys.stderr, flush=True)
        if rank == 0:
            open("ready", "w").close()
            time.sleep(600)
        deadline = time.monotonic() + 60
        while not os.path.exists("ready") and time.monotonic() < deadline:  # process 0 has written its line
            time.sleep(0.05)
        sys.exit(3)
        """
    script = write_script(tmp_path, "fail.py", code)
    with pytest.raises(pytest.fail.Exception) as failed:
        launch([sys.executable, str(script)], 2, cwd=tmp_path, log_dir=tmp_path / "logs", timeout=120, grace=0.5)
    message = str(failed.value)
    assert "process 1 exited with code 3" in message
    assert "stderr of process 0" in message and "stderr of process 1" in message


def test_launcher_kills_a_hang_after_its_timeout(tmp_path, launch):
    script = write_script(tmp_path, "hang.py", "import time\ntime.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        launch([sys.executable, str(script)], 2, cwd=tmp_path, log_dir=tmp_path / "logs", timeout=2)
    assert "timeout after 2 s" in str(failed.value) and "[0, 1] still running" in str(failed.value)


STOP_SCRIPT = """
import json, os, signal, time
import numpy as np
from jax.experimental import multihost_utils
from lm_train.run.distributed import initialize_distributed
from lm_train.run.signals import StopRequest

info = initialize_distributed()
stop = StopRequest(info.process_count)
decisions = []
for step in range(1, 13):
    multihost_utils.process_allgather(np.int32(step))  # the train step's collectives keep the hosts in step
    if info.process_index == 1 and step == 4:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C on one host only, between its steps 3 and 4
        time.sleep(0.05)
    decisions.append(stop.requested(step))
    if decisions[-1]:
        break
stop.restore()
with open(os.environ["MP_RESULT_FILE"], "w") as f:
    json.dump({"decisions": decisions, "status": stop.exit_status()}, f)
"""


def test_a_signal_on_one_process_stops_every_process_after_the_same_next_step(tmp_path, launch):
    script = write_script(tmp_path, "stop.py", STOP_SCRIPT)
    results = launch([sys.executable, str(script)], 2, cwd=tmp_path, log_dir=tmp_path / "logs", timeout=120)
    first, second = (r.result["decisions"] for r in results)
    # The same step for both, and no later than the one after the signal: not the next log step.
    assert first == second
    assert first.index(True) + 1 in (4, 5), first
    assert [r.result["status"] for r in results] == [128 + signal.SIGTERM, 128 + signal.SIGINT]


# -- each process reads only its slice ----------------------------------------------------------------------

SLICE_SCRIPT = """
import json, os, sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from lm_train.config import load_train_config
from lm_train.data.batches import ProcessSlice, TrainBatches
from lm_train.data.caches import prepare_data
from lm_train.run.distributed import initialize_distributed
from lm_train.run.mesh import plan_mesh

info = initialize_distributed()
config, _ = load_train_config([Path(sys.argv[1])])
data = prepare_data(config.data, background=True, progress=False, builder=info.process_index == 0)
batches = TrainBatches.from_caches(
    data, config.data, config.model.Pos.size, config.trainer.train_batch_size, config.trainer.seed,
    ProcessSlice(info.process_index, info.process_count),
)
plan = plan_mesh(config.trainer)
steps = {}
for step in range(int(sys.argv[2])):
    local = batches.batch(step)
    # The trainer's assembly of the global batch from each process's rows, gathered back to every process.
    array = jax.make_array_from_process_local_data(plan.batch_sharding(), np.asarray(local, np.int32))
    assembled = multihost_utils.process_allgather(array, tiled=True)
    steps[step] = {"indices": batches.indices(step).tolist(), "rows": local.tolist(), "global": assembled.tolist()}
data.wait()
multihost_utils.sync_global_devices("done")
with open(os.environ["MP_RESULT_FILE"], "w") as f:
    json.dump(steps, f)
"""


def test_each_process_reads_only_its_slice(tiny_project, tmp_path, launch):
    script = write_script(tmp_path, "slices.py", SLICE_SCRIPT)
    steps = 6
    args = [sys.executable, str(script), str(tiny_project.config), str(steps)]
    (single,) = launch(args, 1, cwd=tiny_project.root, log_dir=tmp_path / "one", devices_per_process=8)
    pair = launch(args, 2, cwd=tiny_project.root, log_dir=tmp_path / "two", devices_per_process=4)
    batch = 8
    for step in map(str, range(steps)):
        whole = single.result[step]
        assert whole["indices"] == list(range(int(step) * batch, (int(step) + 1) * batch))
        first, second = pair[0].result[step], pair[1].result[step]
        # Disjoint halves that together are exactly the global batch: no duplicate, no gap, same order.
        assert len(first["rows"]) == len(second["rows"]) == batch // 2
        assert not set(first["indices"]) & set(second["indices"])
        assert first["indices"] + second["indices"] == whole["indices"]
        assert first["rows"] + second["rows"] == whole["rows"]
        # The assembled global array, as each process sees it, is the single-process batch.
        assert first["global"] == second["global"] == whole["global"] == whole["rows"]
    assert len({tuple(map(tuple, single.result[s]["rows"])) for s in map(str, range(steps))}) == steps


# -- the real CLI, 2 processes x 4 devices ------------------------------------------------------------------


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in trackers.read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run(tiny_project, tmp_path_factory, launch):
    """The tiny config trained by 2 processes x 4 CPU devices through `python -m lm_train run`.

    Its cache is built by the run (`data.cache_build: ray`: so small a corpus would otherwise be tokenized in
    process 0), in a Ray cluster of the two processes' nodes (one per process, as if each were
    a host, one CPU each) that lm-train makes. Without validation data the build is the training set's 2 shards
    alone, so the two tasks go out at once and take a node each: the cluster is what the build runs on.
    """
    run_dir = tiny_project.root / "runs" / "two-processes"
    cache = tmp_path_factory.mktemp("mp-cache")
    args = [*LM_TRAIN, "run", str(tiny_project.config), "--trainer.run_dir", str(run_dir), "--trainer.log_every", "1"]
    args += ["--data.cache_dir", str(cache), "--data.validation_urls", "[]", "--data.cache_build", "ray"]
    args += ["--trainer.ray.node_per", "process", "--trainer.ray.num_cpus", "1", "--trainer.ray.port", str(free_port())]
    results = launch(args, 2, cwd=tiny_project.root, log_dir=tmp_path_factory.mktemp("mp-cli"), timeout=600)
    return run_dir, results


@pytest.fixture(scope="module")
def one_process_run(tiny_project, cli):
    """The same config in 1 process x 8 devices: the same global device count."""
    run_dir = tiny_project.root / "runs" / "one-process"
    args = ["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir), "--trainer.log_every", "1"]
    result = cli(args, tiny_project.root, env={"XLA_FLAGS": xla_flags(8)})
    assert result.returncode == 0, result.output[-5000:]
    return run_dir


def test_two_processes_train_and_checkpoint(two_process_run):
    run_dir, results = two_process_run
    assert [r.returncode for r in results] == [0, 0]
    # lm-train made one Ray cluster of the two processes, and its cache build tokenized on both nodes
    assert "ray: one cluster of 2 nodes (one per process) at 127.0.0.1:" in results[0].stderr
    records = trackers.read_jsonl(run_dir / "metrics.jsonl")
    assert max(r.get("preprocessing/nodes", 0) for r in records) == 2
    # every node stopped with its process: no Ray daemon of this cluster is left
    port = results[0].stderr.split("ray: one cluster of 2 nodes (one per process) at 127.0.0.1:")[1].split(";")[0]
    daemons = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"127.0.0.1:{port}" not in daemons
    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, 13))
    assert curve[12] < curve[1]
    assert not list(run_dir.glob("metrics.process-*"))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert checkpoints == ["step-10", "step-12", "step-2", "step-4", "step-6", "step-8"]
    manifest = dist_ckpt.load(run_dir / "checkpoints" / "step-12", progress=False)
    assert int(manifest[".step"]) == 12


def test_two_processes_match_one_process_with_the_same_devices(two_process_run, one_process_run):
    two, one = losses(two_process_run[0]), losses(one_process_run)
    assert sorted(two) == sorted(one) == list(range(1, 13))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=0, atol=1e-5)


def test_one_process_resumes_the_two_process_checkpoint(tiny_project, two_process_run, one_process_run, cli):
    source = two_process_run[0] / "checkpoints" / "step-6"
    run_dir = tiny_project.root / "runs" / "resumed-alone"
    args = [
        "run",
        str(tiny_project.config),
        "--trainer.run_dir",
        str(run_dir),
        "--trainer.log_every",
        "1",
        "--trainer.load_checkpoint_path",
        str(source),
    ]
    result = cli(args, tiny_project.root, env={"XLA_FLAGS": xla_flags(8)})
    assert result.returncode == 0, result.output[-5000:]
    assert f"resuming from {source}" in result.output
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(7, 13))
    one = losses(one_process_run)
    np.testing.assert_allclose([resumed[s] for s in range(7, 13)], [one[s] for s in range(7, 13)], rtol=0, atol=1e-5)
    assert dist_ckpt.latest(run_dir / "checkpoints").name == "step-12"


# -- every logged number agrees across layouts --------------------------------------------------------------

# Logged every step, evaluated every other; per_device_parallelism 1 makes 1 device accumulate 8 microbatches.
AGREEMENT = ["--trainer.log_every", "1", "--trainer.num_train_steps", "4", "--trainer.steps_per_eval", "2"]
AGREEMENT += ["--trainer.per_device_parallelism", "1"]
TIMING_KEYS = ("throughput/", "time/")  # how fast this machine ran: the only keys that may differ


@pytest.fixture(scope="module")
def layouts(tiny_project, one_process_run, cli, launch, tmp_path_factory):
    """The same short run on 1 process x 8 devices, 2 processes x 4 and 1 process x 1, all on the finished cache
    of `one_process_run` (so none of them logs a cache build's figures)."""
    runs = {name: tiny_project.root / "runs" / f"layout-{name}" for name in ("1x8", "2x4", "1x1")}

    def args(name: str) -> list[str]:
        return ["run", str(tiny_project.config), "--trainer.run_dir", str(runs[name]), *AGREEMENT]

    for name, devices in (("1x8", 8), ("1x1", 1)):
        flags = {"XLA_FLAGS": xla_flags(devices)}
        result = cli(args(name), tiny_project.root, env=flags)
        assert result.returncode == 0, result.output[-5000:]
    launch([*LM_TRAIN, *args("2x4")], 2, cwd=tiny_project.root, log_dir=tmp_path_factory.mktemp("layouts"))
    return runs


def logged_values(run_dir: Path) -> dict[tuple[int, str], float]:
    """Every number of metrics.jsonl, by (step, key)."""
    values = {}
    for row in trackers.read_jsonl(run_dir / "metrics.jsonl"):
        values.update({(row["step"], key): value for key, value in row.items() if key != "step"})
    return values


def test_every_logged_metric_agrees_across_process_and_device_counts(layouts):
    reference = logged_values(layouts["1x8"])
    assert {"train/loss", "optim/grad_norm", "optim/learning_rate", "eval/loss"} <= {key for _, key in reference}
    assert sorted({step for step, _ in reference}) == [1, 2, 3, 4]
    for name in ("2x4", "1x1"):
        values = logged_values(layouts[name])
        hosts = {key for key in values if key[1].startswith("hosts/")}
        assert bool(hosts) == (name == "2x4"), name  # per-host step times: a run of several processes only
        values = {key: value for key, value in values.items() if key not in hosts}
        assert values.keys() == reference.keys(), name
        differing = {
            key: (values[key], reference[key])
            for key in reference
            if not key[1].startswith(TIMING_KEYS) and values[key] != pytest.approx(reference[key], rel=1e-5, abs=1e-7)
        }
        assert not differing, f"{name} vs 1x8: {differing}"
