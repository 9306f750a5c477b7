"""The gcloud command lines that ship a prepared launch to every worker of a Cloud TPU VM and start one process on
each (all at once for a dry run, or one ssh session per worker for the launcher to watch), stop them, and describe
the VM: jax.distributed finds the slice's hosts itself there, so no coordinator is handed out."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.snapshot import LaunchError

TPU_PASSED = ("LM_TRAIN_COORDINATOR_ADDRESS", "LM_TRAIN_NUM_PROCESSES", "LM_TRAIN_PROCESS_ID")
"""Left out on a TPU VM: each worker's jax.distributed reads the slice from the TPU metadata instead."""


@dataclass(frozen=True)
class TpuTarget:
    """Which TPU VM, and how its workers run Python."""

    name: str
    zone: str
    project: str | None = None
    python: str = "python3"
    """The interpreter on the workers, with the project's dependencies installed."""


def _gcloud(target: TpuTarget, verb: str) -> list[str]:
    project = [f"--project={target.project}"] if target.project else []
    return ["gcloud", "compute", "tpus", "tpu-vm", verb, *project, f"--zone={target.zone}"]


def remote_dir(prepared: PreparedLaunch) -> str:
    """The shipped folder on each worker (relative to the user's home there)."""
    return f"lm-train-launch/{prepared.run_id}"


PID_FILE = "lm-train.pid"
"""In the shipped folder on each worker: the training process's pid, for the stop line."""


def _remote(prepared: PreparedLaunch, target: TpuTarget, *, watched: bool) -> str:
    """The shell line each worker runs: the shipped code first on PYTHONPATH, the caller's run variables, then the
    run; a watched one records its pid and becomes the run (exec), so that the stop line can signal it."""
    folder = remote_dir(prepared)
    env = {k: v for k, v in sorted(prepared.env.items()) if k not in TPU_PASSED}
    start = prepared.argv(target.python, ".")  # run from inside the shipped folder
    pythonpath = ":".join(f"$PWD/{d}" for d in prepared.source_dirs)
    return " ".join(
        [
            f"cd $HOME/{shlex.quote(folder)} &&",
            *([f"echo $$ > {PID_FILE} && exec"] if watched else []),
            "env",
            *(shlex.quote(f"{k}={v}") for k, v in env.items()),
            f'PYTHONPATH="{pythonpath}${{PYTHONPATH:+:$PYTHONPATH}}"',
            shlex.join(start),
        ]
    )


def copy_lines(prepared: PreparedLaunch, target: TpuTarget) -> list[list[str]]:
    """Remove an older copy on every worker, and copy the shipped folder there."""
    folder = remote_dir(prepared)
    return [
        [
            *_gcloud(target, "ssh"),
            target.name,
            "--worker=all",
            f"--command=rm -rf $HOME/{folder} && mkdir -p $HOME/{folder}",
        ],
        [*_gcloud(target, "scp"), "--worker=all", "--recurse", f"{prepared.workdir}/.", f"{target.name}:{folder}"],
    ]


def command_lines(prepared: PreparedLaunch, target: TpuTarget) -> list[list[str]]:
    """Remove an older copy, copy the shipped folder, and start `lm-train run` on every worker (a dry run's lines)."""
    remote = _remote(prepared, target, watched=False)
    return [
        *copy_lines(prepared, target),
        [*_gcloud(target, "ssh"), target.name, "--worker=all", f"--command={remote}"],
    ]


def start_line(prepared: PreparedLaunch, target: TpuTarget, worker: int) -> list[str]:
    """Start `lm-train run` on one worker, in an ssh session that lasts as long as it runs (its exit status is the
    run's, or 255, ssh's own, when the connection to the worker was lost)."""
    remote = _remote(prepared, target, watched=True)
    return [*_gcloud(target, "ssh"), target.name, f"--worker={worker}", f"--command={remote}"]


def stop_line(prepared: PreparedLaunch, target: TpuTarget, grace_s: int = 60) -> list[str]:
    """SIGTERM to the run's process on every worker (it saves at its next step if it can), SIGKILL after
    `grace_s`: a restart must not start beside processes of the last start."""
    pid = f"$HOME/{shlex.quote(remote_dir(prepared))}/{PID_FILE}"
    stop = (
        f"pid=$(cat {pid} 2>/dev/null) && kill -TERM $pid 2>/dev/null && "
        f"for i in $(seq {grace_s}); do kill -0 $pid 2>/dev/null || break; sleep 1; done; "
        "kill -KILL $pid 2>/dev/null; true"
    )
    return [*_gcloud(target, "ssh"), target.name, "--worker=all", f"--command={stop}"]


def describe_line(target: TpuTarget) -> list[str]:
    """The VM's state and its workers (networkEndpoints), as JSON."""
    return [*_gcloud(target, "describe"), target.name, "--format=json"]


def check_gcloud() -> None:
    """A clear error when gcloud is not installed here."""
    if shutil.which("gcloud") is None:
        raise LaunchError(
            "gcloud is not installed here, so the TPU VM cannot be reached. Install the Google Cloud CLI and log in "
            "(`gcloud auth login`), or pass --dry-run to print the commands and run them where gcloud is."
        )


def run_commands(lines: list[list[str]]) -> int:
    """Run the command lines in order; the first failing one's status."""
    check_gcloud()
    for line in lines:
        print(f"launch: {shlex.join(line)}", file=sys.stderr, flush=True)
        status = subprocess.run(line, check=False).returncode
        if status != 0:
            return status
    return 0
