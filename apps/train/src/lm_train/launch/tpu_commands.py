"""The gcloud command lines that ship a prepared launch to every worker of a Cloud TPU VM and start one process on
each: jax.distributed finds the slice's hosts itself there, so no coordinator is handed out."""

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


def command_lines(prepared: PreparedLaunch, target: TpuTarget) -> list[list[str]]:
    """Remove an older copy, copy the shipped folder, and start `lm-train run` on every worker."""
    folder = remote_dir(prepared)
    env = {k: v for k, v in sorted(prepared.env.items()) if k not in TPU_PASSED}
    start = prepared.argv(target.python, ".")  # run from inside the shipped folder
    pythonpath = ":".join(f"$PWD/{d}" for d in prepared.source_dirs)
    # One shell line per worker: the shipped code first on PYTHONPATH, the caller's run variables, then the run.
    remote = " ".join(
        [
            f"cd $HOME/{shlex.quote(folder)} &&",
            "env",
            *(shlex.quote(f"{k}={v}") for k, v in env.items()),
            f'PYTHONPATH="{pythonpath}${{PYTHONPATH:+:$PYTHONPATH}}"',
            shlex.join(start),
        ]
    )
    return [
        [
            *_gcloud(target, "ssh"),
            target.name,
            "--worker=all",
            f"--command=rm -rf $HOME/{folder} && mkdir -p $HOME/{folder}",
        ],
        [*_gcloud(target, "scp"), "--worker=all", "--recurse", f"{prepared.workdir}/.", f"{target.name}:{folder}"],
        [*_gcloud(target, "ssh"), target.name, "--worker=all", f"--command={remote}"],
    ]


def run_commands(lines: list[list[str]]) -> int:
    """Run the command lines in order; the first failing one's status (the last is the run on every worker)."""
    if shutil.which("gcloud") is None:
        raise LaunchError(
            "gcloud is not installed here, so the TPU VM cannot be reached. Install the Google Cloud CLI and log in "
            "(`gcloud auth login`), or pass --dry-run to print the commands and run them where gcloud is."
        )
    for line in lines:
        print(f"launch: {shlex.join(line)}", file=sys.stderr, flush=True)
        status = subprocess.run(line, check=False).returncode
        if status != 0:
            return status
    return 0
