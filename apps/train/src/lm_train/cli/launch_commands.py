"""`lm-train launch ray|slurm|tpu`: the same training as `lm-train run`, one process per host of a cluster,
restarted after a lost host."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Annotated

import typer

from lm_train.cli.app import CONTEXT, ConfigFiles, Debug, app, handles_user_errors, load_from_args
from lm_train.errors import UserError

launch_app = typer.Typer(help="Start a run on the hosts of a cluster, and restart it when a host is lost.")
app.add_typer(launch_app, name="launch", no_args_is_help=True)


def _checked_config(configs: list[str], extra: list[str]):
    """The config as `lm-train run` loads and checks it: a bad one fails here, before anything is shipped."""
    from lm_train.kinds import KINDS

    config, files = load_from_args(configs, extra)
    next(entry for entry in KINDS if entry.command == "run").load().check_config(config)
    return config, files


# The options of every backend: which checkout is shipped, and whether it must be clean.
RequireClean = Annotated[bool, typer.Option("--require-clean", help="Refuse a checkout with uncommitted changes.")]
Source = Annotated[
    Path | None, typer.Option("--source", help="The git checkout to ship (default: the one lm-train runs from).")
]
FinishWait = Annotated[
    int,
    typer.Option("--finish-wait", help="Seconds the other processes get to exit once process 0 has finished."),
]
MinHosts = Annotated[
    int | None,
    typer.Option(
        "--min-hosts",
        help="Start or restart on fewer hosts, down to this many; given, the first start waits --wait-for-hosts for "
        "free hosts (default: --hosts, and fewer alive are refused at once).",
    ),
]
TasksPerNode = Annotated[
    int, typer.Option("--tasks-per-node", help="Training processes per host, e.g. one per GPU (default 1).")
]
WaitForHosts = Annotated[
    float,
    typer.Option(
        "--wait-for-hosts",
        help="Seconds to wait for --hosts hosts after a lost one (and at the start, with --min-hosts) before going "
        "on with fewer, or giving up.",
    ),
]


def _checked_counts(hosts: int, min_hosts: int | None, tasks_per_node: int, wait_for_hosts: float) -> int:
    """The minimum of hosts to restart on; a clear error for counts that make no sense."""
    if tasks_per_node < 1 or wait_for_hosts < 0:
        raise UserError(
            f"--tasks-per-node must be at least 1 (got {tasks_per_node}) and --wait-for-hosts at least 0 s (got "
            f"{wait_for_hosts})."
        )
    minimum = hosts if min_hosts is None else min_hosts
    if not 1 <= minimum <= hosts:
        raise UserError(f"--min-hosts must be between 1 and --hosts {hosts}, got {minimum}.")
    return minimum


@launch_app.command("ray", context_settings=CONTEXT)
@handles_user_errors
def ray_command(
    ctx: typer.Context,
    configs: ConfigFiles,
    hosts: Annotated[int, typer.Option("--hosts", help="Training processes, one per Ray node.")],
    address: Annotated[
        str | None, typer.Option("--address", help="The Ray cluster (host:port of its head); default $RAY_ADDRESS.")
    ] = None,
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="Restarts after a lost host or failure.")] = 3,
    min_hosts: MinHosts = None,
    tasks_per_node: TasksPerNode = 1,
    wait_for_hosts: WaitForHosts = 60.0,
    heartbeat_timeout: Annotated[
        float, typer.Option("--heartbeat-timeout", help="Seconds without an answer from a host before it is lost.")
    ] = 60.0,
    cpus_per_host: Annotated[
        float,
        typer.Option("--cpus-per-host", help="CPUs reserved per host (default 0: all left to cache builds' tasks)."),
    ] = 0.0,
    finish_wait: FinishWait = 120,
    require_clean: RequireClean = False,
    source: Source = None,
    debug: Debug = False,
) -> None:
    """Train on a Ray cluster: `lm-train launch ray CONFIG.yaml --hosts 4 [--address HEAD:6379] [--key value ...]`;
    the same command again resumes the run."""
    from lm_train.launch.prepared import prepare_launch
    from lm_train.launch.ray_backend import RayBackend

    if hosts < 1 or max_restarts < 0 or heartbeat_timeout <= 0 or cpus_per_host < 0 or finish_wait < 1:
        raise UserError(
            f"--hosts must be at least 1 (got {hosts}), --max-restarts at least 0 (got {max_restarts}), "
            f"--heartbeat-timeout positive (got {heartbeat_timeout}), --cpus-per-host at least 0 (got "
            f"{cpus_per_host}) and --finish-wait at least 1 s (got {finish_wait})."
        )
    minimum = _checked_counts(hosts, min_hosts, tasks_per_node, wait_for_hosts)
    cluster = address or os.environ.get("RAY_ADDRESS")
    if not cluster:
        raise UserError(
            "No Ray cluster given: pass --address HEAD:6379 (the address `ray status` shows on the head node) or "
            "set RAY_ADDRESS."
        )
    config, files = _checked_config(configs, ctx.args)
    prepared = prepare_launch(config, files, "ray", source=source, require_clean=require_clean)
    try:
        backend = RayBackend(
            cluster,
            cpus_per_host=cpus_per_host,
            heartbeat_timeout_s=heartbeat_timeout,
            finish_wait_s=finish_wait,
            tasks_per_node=tasks_per_node,
        )
        backend.connect(prepared)
        status = _supervised(prepared, backend, hosts, minimum, max_restarts, wait_for_hosts, min_hosts is not None)
    finally:
        shutil.rmtree(prepared.workdir, ignore_errors=True)
    if status:
        raise typer.Exit(status)


def _supervised(prepared, backend, hosts: int, minimum: int, restarts: int, wait_for_hosts: float, wait: bool) -> int:
    """The launch supervised on `backend` (Ray's or SLURM's) to its end; the backend is closed after it."""
    from lm_train.launch.supervise import supervise

    try:
        return supervise(
            prepared,
            backend,
            hosts=hosts,
            min_hosts=minimum,
            max_restarts=restarts,
            wait_for_hosts_s=wait_for_hosts,
            wait_at_start=wait,
        )
    finally:
        backend.close()


@launch_app.command("tpu", context_settings=CONTEXT)
@handles_user_errors
def tpu_command(
    ctx: typer.Context,
    configs: ConfigFiles,
    tpu: Annotated[str, typer.Option("--tpu", help="The TPU VM's name.")],
    zone: Annotated[str, typer.Option("--zone", help="Its zone, e.g. us-central2-b.")],
    project: Annotated[str | None, typer.Option("--project", help="Its Google Cloud project.")] = None,
    python: Annotated[str, typer.Option("--python", help="The workers' Python with lm-stack's dependencies.")] = (
        "python3"
    ),
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the gcloud commands instead of running them.")] = (
        False
    ),
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", help="Restarts after a lost worker or a failed process.")
    ] = 3,
    wait_for_hosts: WaitForHosts = 60.0,
    require_clean: RequireClean = False,
    source: Source = None,
    debug: Debug = False,
) -> None:
    """Train on every worker of a Cloud TPU VM: `lm-train launch tpu CONFIG.yaml --tpu NAME --zone Z [--dry-run]`;
    the same command again resumes the run."""
    import shlex

    from lm_train.launch.prepared import prepare_launch
    from lm_train.launch.tpu_commands import TpuTarget, command_lines

    if max_restarts < 0 or wait_for_hosts < 0:
        raise UserError(
            f"--max-restarts must be at least 0 (got {max_restarts}) and --wait-for-hosts at least 0 s (got "
            f"{wait_for_hosts})."
        )
    config, files = _checked_config(configs, ctx.args)
    prepared = prepare_launch(config, files, "tpu", source=source, require_clean=require_clean)
    target = TpuTarget(tpu, zone, project, python)
    if dry_run:  # the shipped folder stays, for the scp line to copy
        typer.echo("\n".join(shlex.join(line) for line in command_lines(prepared, target)))
        return
    try:
        status = _run_on_tpu(prepared, target, max_restarts, wait_for_hosts)
    finally:
        shutil.rmtree(prepared.workdir, ignore_errors=True)
    if status:
        raise typer.Exit(status)


def _run_on_tpu(prepared, target, restarts: int, wait_for_hosts: float) -> int:
    from lm_train.launch.snapshot import LaunchError
    from lm_train.launch.supervise import supervise
    from lm_train.launch.tpu_backend import TpuBackend

    backend = TpuBackend(target)
    workers = backend.hosts_available()
    if workers == 0:
        said = f" (gcloud: {backend.describe_error.rstrip('.')})" if backend.describe_error else ""
        raise LaunchError(
            f"The TPU VM {target.name} (zone {target.zone}) is not READY, or gcloud cannot describe it{said}: `gcloud "
            f"compute tpus tpu-vm describe {target.name} --zone {target.zone}` shows its state. Start it, or wait "
            "until it is READY, then launch again."
        )
    # A slice runs on all its workers or not at all: no restart on fewer.
    return supervise(
        prepared, backend, hosts=workers, min_hosts=workers, max_restarts=restarts, wait_for_hosts_s=wait_for_hosts
    )


@launch_app.command("slurm", context_settings=CONTEXT)
@handles_user_errors
def slurm_command(
    ctx: typer.Context,
    configs: ConfigFiles,
    hosts: Annotated[int, typer.Option("--hosts", help="Nodes of the job (--tasks-per-node processes on each).")],
    partition: Annotated[
        str | None, typer.Option("--partition", help="The SLURM partition (default: the cluster's default).")
    ] = None,
    time_limit: Annotated[
        str | None, typer.Option("--time", help="The job's time limit, as sbatch takes it (e.g. 2-00:00:00).")
    ] = None,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", help="Requeues and resubmissions after a preemption or failure.")
    ] = 3,
    min_hosts: MinHosts = None,
    tasks_per_node: TasksPerNode = 1,
    wait_for_hosts: WaitForHosts = 60.0,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option("--sbatch-arg", help="One more sbatch option, e.g. --sbatch-arg=--gres=gpu:8 (repeatable)."),
    ] = None,
    python: Annotated[
        str | None, typer.Option("--python", help="The nodes' Python with lm-stack's dependencies (default: this one).")
    ] = None,
    finish_wait: FinishWait = 120,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the sbatch script instead of submitting it.")] = (
        False
    ),
    require_clean: RequireClean = False,
    source: Source = None,
    debug: Debug = False,
) -> None:
    """Train on a SLURM cluster: `lm-train launch slurm CONFIG.yaml --hosts 4 [--partition P] [--key value ...]`;
    the same command again resumes the run."""
    import sys

    from lm_train.launch.prepared import prepare_launch
    from lm_train.launch.slurm_backend import SlurmBackend

    if hosts < 1 or max_restarts < 0 or finish_wait < 1:
        raise UserError(
            f"--hosts must be at least 1 (got {hosts}), --max-restarts at least 0 (got {max_restarts}) and "
            f"--finish-wait at least 1 s (got {finish_wait})."
        )
    minimum = _checked_counts(hosts, min_hosts, tasks_per_node, wait_for_hosts)
    config, files = _checked_config(configs, ctx.args)
    backend = SlurmBackend(
        partition=partition,
        time_limit=time_limit,
        sbatch_args=tuple(sbatch_arg or ()),
        python=python or sys.executable,
        finish_wait_s=finish_wait,
        tasks_per_node=tasks_per_node,
    )
    if not dry_run:
        backend.check_partition()  # before the snapshot: a cluster that cannot take the job is named at once
    prepared = prepare_launch(config, files, "slurm", source=source, require_clean=require_clean)
    try:
        if dry_run:
            typer.echo(backend.prepare_job(prepared, hosts, prepared.run_dir / "slurm" / "launch-DRY-RUN")[1])
            return
        backend.check_no_job_of(prepared)
        status = _supervised(prepared, backend, hosts, minimum, max_restarts, wait_for_hosts, min_hosts is not None)
    finally:
        shutil.rmtree(prepared.workdir, ignore_errors=True)
    if status:
        raise typer.Exit(status)
