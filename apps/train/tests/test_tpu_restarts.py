"""`lm-train launch tpu` without a dry run: the exact gcloud lines it runs (one ssh session per worker, the stop,
the describe), and its restart decision fed recorded exits of the workers' sessions (no gcloud here)."""

import shlex
from pathlib import Path

from lm_train.config.schema import LaunchRecord
from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.tpu_backend import decide
from lm_train.launch.tpu_commands import TpuTarget, command_lines, copy_lines, describe_line, start_line, stop_line

GCLOUD = ["gcloud", "compute", "tpus", "tpu-vm"]
WHERE = ["--project=lab", "--zone=us-central2-b"]


def prepared(tmp_path: Path) -> PreparedLaunch:
    env = {"WANDB_MODE": "offline"}
    return PreparedLaunch("tpu-run", tmp_path / "run", tmp_path / "ship", ("src",), env, "/", LaunchRecord("tpu"))


def test_each_worker_runs_in_its_own_session_that_records_the_pid_the_stop_line_signals(tmp_path):
    launch, target = prepared(tmp_path), TpuTarget("pod-1", "us-central2-b", "lab")
    folder = "lm-train-launch/tpu-run"
    run = 'env WANDB_MODE=offline PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python3 -m lm_train run '
    run += "lm-train-launch/config.yaml"
    assert start_line(launch, target, 3) == [
        *GCLOUD,
        "ssh",
        *WHERE,
        "pod-1",
        "--worker=3",
        f"--command=cd $HOME/{folder} && echo $$ > lm-train.pid && exec {run}",
    ]
    # The dry run's lines are the copy lines, then the same run on every worker at once (no pid: nothing watches).
    assert command_lines(launch, target)[:2] == copy_lines(launch, target)
    assert command_lines(launch, target)[2][-1] == f"--command=cd $HOME/{folder} && {run}"
    stop = stop_line(launch, target, grace_s=30)
    assert stop[:-1] == [*GCLOUD, "ssh", *WHERE, "pod-1", "--worker=all"]
    assert stop[-1] == (
        f"--command=pid=$(cat $HOME/{folder}/lm-train.pid 2>/dev/null) && kill -TERM $pid 2>/dev/null && "
        "for i in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill -KILL $pid 2>/dev/null; true"
    )
    assert shlex.join(describe_line(target)) == (
        "gcloud compute tpus tpu-vm describe --project=lab --zone=us-central2-b pod-1 --format=json"
    )


def test_the_restart_decision_from_the_workers_recorded_exits():
    assert decide({}, 4) is None and decide({2: 0}, 4) is None  # running; a worker done before process 0 waits
    assert decide({0: 0}, 4).exit_status == 0  # process 0 finished the run: the others are stopped
    assert decide({0: 0, 1: 0, 2: 0, 3: 0}, 4).exit_status == 0
    lost = decide({2: 255}, 4)
    assert (lost.exit_status, lost.restartable) == (255, True) and "ssh session to worker 2 was lost" in lost.cause
    crashed = decide({1: 0, 3: 75}, 4)  # the watchdog's exit
    assert (crashed.exit_status, crashed.restartable) == (75, True)
    assert crashed.cause == "the training process of worker 3 exited with status 75"
    bad = decide({1: 134, 3: 2}, 4)  # bad input anywhere: no restart can help
    assert (bad.exit_status, bad.restartable) == (2, False) and "worker 3" in bad.cause
    killed = decide({0: -15}, 4)
    assert killed.restartable and "killed by signal 15 on this machine" in killed.cause
