"""SLURM's client commands as the launcher asks them: the partition, the nodes up, a run's jobs, a job's state."""

from __future__ import annotations

import re
import subprocess

from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.snapshot import LaunchError

USABLE = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing", "plnd", "planned"}
"""Node states (sinfo's short names, without their flag characters) that can run a job now or soon."""


def run(args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one SLURM command; a clear error when it is not installed."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise LaunchError(
            f"`{args[0]}` is not installed here, so SLURM cannot be reached. Run `lm-train launch slurm` on a login "
            "node of the cluster (where sbatch, squeue and scontrol are), or install SLURM's client commands."
        ) from None


def job_name(prepared: PreparedLaunch) -> str:
    """The SLURM job name of a launched run: the same for every launch of the run."""
    return f"lm-train-{prepared.run_id}"


def checked_partition(partition: str | None) -> str:
    """The partition the job goes to (`partition`, else the cluster's default); a clear error when SLURM has no
    such partition or cannot be reached."""
    done = run(["sinfo", "-h", "-o", "%P"])
    if done.returncode != 0:
        raise LaunchError(
            f"SLURM's controller did not answer `sinfo`: {done.stderr.strip() or done.returncode}. Check that "
            "slurmctld runs and that this machine's slurm.conf (or $SLURM_CONF) points at it."
        )
    names = [p.strip() for p in done.stdout.split()]
    plain = [p.rstrip("*") for p in names]
    if partition is None:
        default = [p.rstrip("*") for p in names if p.endswith("*")]
        if not default:
            raise LaunchError(f"SLURM has no default partition; pass --partition (its partitions: {', '.join(plain)}).")
        return default[0]
    if partition not in plain:
        raise LaunchError(
            f"SLURM has no partition {partition!r} (--partition); its partitions are: "
            f"{', '.join(plain) or 'none'}. Pass one of them (`sinfo` lists them with their nodes)."
        )
    return partition


def nodes_up(partition: str) -> int:
    """Nodes of the partition that are up (idle, in use or completing), whether or not another job holds them."""
    done = run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"])
    nodes = {}
    for line in done.stdout.splitlines():
        name, _, state = line.strip().partition(" ")
        nodes[name] = state.strip().rstrip("*~#!%$@^-+").lower()
    return sum(1 for state in nodes.values() if state in USABLE)


def nodes_free(partition: str, cpus: int) -> int:
    """Nodes of the partition that could start a job's tasks now: idle, or in use with `cpus` CPUs idle (not
    drained, down or unresponsive)."""
    done = run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t %C"])
    free = set()
    for line in done.stdout.splitlines():
        name, state, counts = [*line.split(), "", ""][:3]
        idle = counts.split("/")[1] if counts.count("/") == 3 else "0"
        # A flag (`*` unresponsive, `~` powered off, `#` powering up, `!`/`%` powering down) means not now.
        if state in {"idle", "mix"} and int(idle) >= cpus:
            free.add(name)
    return len(free)


def check_no_job_of(prepared: PreparedLaunch) -> None:
    """A clear error when a job of this run is still queued or running (a launcher that was killed leaves its job
    behind): two jobs of one run would write the same checkpoints."""
    done = run(["squeue", "-h", "-n", job_name(prepared), "-o", "%i %T"])
    active = [line.split() for line in done.stdout.splitlines() if line.strip()]
    if active:
        jobs = ", ".join(f"{job_id} ({state})" for job_id, state, *_ in active)
        raise LaunchError(
            f"Run {prepared.run_id} already has SLURM job {jobs} queued or running (`squeue -n "
            f"{job_name(prepared)}`). Wait for it to end, or cancel it (`scancel {active[0][0]}`), then launch "
            "again: it resumes from the newest intact checkpoint."
        )


def job_state(job_id: str) -> dict[str, str]:
    """JobState, Restarts, ExitCode, NodeList, Reason... of the job; from sacct once scontrol forgot it."""
    done = run(["scontrol", "show", "job", "-o", job_id])
    if done.returncode == 0 and done.stdout.strip():
        # `scontrol show -o` output as a dict (values without spaces: the ones read here).
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))
    done = run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,NodeList"])
    if done.returncode == 0 and done.stdout.strip():
        state, exit_code, nodes = done.stdout.strip().splitlines()[-1].split("|")[:3]
        return {"JobState": state.split()[0], "ExitCode": exit_code, "NodeList": nodes, "Restarts": "-1"}
    return {"JobState": "UNKNOWN"}
