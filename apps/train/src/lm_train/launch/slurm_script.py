"""The sbatch script of a SLURM launch: `lm-train run` once per task through srun (one task per node, or
--tasks-per-node), the coordinator being the first node of the allocation, each process's id its SLURM_PROCID."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from lm_train.launch.prepared import LAUNCHER_SETS, PreparedLaunch

STATUS_PREFIX = "status-"
"""<job_dir>/status-<procid>: a process's exit status, written by its task as it ends (the job's own exit code is
srun's, which cannot tell a finished process 0 from the straggler srun stopped)."""


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch script asks of SLURM, and where the job's files go."""

    hosts: int
    job_dir: Path
    """On the shared file system: the shipped code (code/), the script, each process's console and status."""
    partition: str | None = None
    time_limit: str | None = None
    python: str = "python3"
    finish_wait_s: int = 120
    """srun --wait: once a process has exited, the others get this long before srun stops them."""
    tasks_per_node: int = 1
    """Training processes per node (e.g. one per GPU): process ids go node by node, node * tasks + local index."""

    @property
    def processes(self) -> int:
        return self.hosts * self.tasks_per_node

    @property
    def code_dir(self) -> Path:
        return self.job_dir / "code"

    def process_log(self, process: int) -> Path:
        return self.job_dir / f"process-{process}.log"

    def status_file(self, process: int) -> Path:
        return self.job_dir / f"{STATUS_PREFIX}{process}"


WAITER = (
    "import signal, subprocess, sys; signal.signal(signal.SIGTERM, lambda *_: None); "
    "s = subprocess.call(sys.argv[2:]); s = 128 - s if s < 0 else s; "
    "open(sys.argv[1], 'w').write(f'{s}\\n'); sys.exit(s)"
)
"""A task's parent of lm-train: it ignores SIGTERM with a handler (its child gets the default back at exec, and
lm-train its own), waits (PEP 475 retries the wait after each signal), writes the exit status (128 + a signal's
number, as shells do) to argv[1] and exits with it."""


def batch_script(prepared: PreparedLaunch, job: SlurmJob, job_name: str) -> str:
    """The script that sbatch runs on the allocation's first node, on every start of the job (requeues included)."""
    code = str(job.code_dir)
    directives = [
        f"--job-name={job_name}",
        f"--nodes={job.hosts}",
        f"--ntasks-per-node={job.tasks_per_node}",
        # A preempted or requeued job runs this script again: the run resumes from its newest intact checkpoint.
        "--requeue",
        "--open-mode=append",
        f"--output={job.job_dir}/slurm-%j.out",
    ]
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.time_limit:
        # SIGTERM two minutes before the limit: lm-train saves and stops, and the launcher submits the job again.
        directives += [f"--time={job.time_limit}", "--signal=TERM@120"]
    pythonpath = ":".join(str(job.code_dir / d) for d in prepared.source_dirs)
    exports = [f"export {k}={shlex.quote(v)}" for k, v in sorted(prepared.env.items())]
    argv = prepared.argv(job.python, code)
    # Each task records its process's exit status: srun's tells only that some task failed or was stopped. SLURM
    # signals every process of the step, and again when srun ends the step after process 0's exit (143 after a
    # SIGTERM counts as a bad exit): a small Python parent outlives those signals while lm-train saves and exits,
    # and waits for it in os.waitpid (a shell's `wait` interrupted by a trapped signal as its child exited was seen
    # to report -1, recorded as 255).
    task = (
        'export LM_TRAIN_PROCESS_ID="$SLURM_PROCID" LM_TRAIN_LOCAL_PROCESS_ID="$SLURM_LOCALID"; '
        f"exec {shlex.quote(job.python)} -c {shlex.quote(WAITER)} "
        f'{shlex.quote(str(job.job_dir))}/{STATUS_PREFIX}"$SLURM_PROCID" "$@"'
    )
    srun = [
        "srun",
        f"--nodes={job.hosts}",
        f"--ntasks-per-node={job.tasks_per_node}",
        "--kill-on-bad-exit=1",
        f"--wait={job.finish_wait_s}",
        "--open-mode=append",
        f"--output={job.job_dir}/process-%t.log",
    ]
    if job.tasks_per_node > 1:
        # Tasks numbered node by node (SLURM's default, made sure of here): process id = node * tasks + local index.
        srun.append("--distribution=block")
    lines = [
        "#!/bin/bash",
        f"# Written by `lm-train launch slurm` for run {prepared.run_id}; SLURM runs it again on every requeue.",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "# The caller's variables that configure a run; the launcher's own are set per start below.",
        *exports,
        f"unset {' '.join(LAUNCHER_SETS)}",
        f'export PYTHONPATH="{pythonpath}${{PYTHONPATH:+:$PYTHONPATH}}"',
        "",
        "# Process 0 runs on the allocation's first node, where this script runs: its address, and a free port.",
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'addr=$(scontrol show node -o "$first" | sed -n "s/.* NodeAddr=\\([^ ]*\\).*/\\1/p")',
        f"port=$({shlex.quote(job.python)} -c "
        + shlex.quote('import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
        + ")",
        'export LM_TRAIN_COORDINATOR_ADDRESS="${addr:-$first}:$port"',
        f'export LM_TRAIN_NUM_PROCESSES="$((SLURM_NNODES * {job.tasks_per_node}))" '
        f"LM_TRAIN_LOCAL_PROCESS_COUNT={job.tasks_per_node}",
        f"rm -f {shlex.quote(str(job.job_dir))}/{STATUS_PREFIX}*",
        'echo "lm-train launch: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST,'
        ' coordinator $LM_TRAIN_COORDINATOR_ADDRESS"',
        "# The caller's directory where the node has it (a shared file system): the config's relative paths.",
        f"cd {shlex.quote(prepared.cwd)} 2>/dev/null || cd {shlex.quote(code)}",
        shlex.join([*srun, "bash", "-c", task, "lm-train", *argv]),
        "",
    ]
    return "\n".join(lines)
