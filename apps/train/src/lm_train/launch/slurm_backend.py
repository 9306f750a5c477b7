"""The SLURM backend: the prepared launch copied to the shared file system, submitted with sbatch, followed with
scontrol (sacct once the controller has forgotten the job), process 0's console streamed from its log file.

A start is one run of the job's script: a requeue by SLURM (preemption, a failed node, `scontrol requeue`) ends a
start and the next follows the same job; a job that ended (preempted, node failure, time limit, a failed process)
is submitted again."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.slurm_script import STATUS_PREFIX, SlurmJob, batch_script
from lm_train.launch.snapshot import LaunchError
from lm_train.launch.supervise import BAD_INPUT_STATUS, LaunchLog, Outcome

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}
ENDED |= {"OUT_OF_MEMORY"}
MAYBE_REQUEUED = {"PREEMPTED", "NODE_FAIL"}
"""Ends after which SLURM itself may requeue a requeueable job a moment later."""
USABLE = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing", "plnd", "planned"}
"""Node states (sinfo's short names, without their flag characters) that can run a job now or soon."""


def _run(args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise LaunchError(
            f"`{args[0]}` is not installed here, so SLURM cannot be reached. Run `lm-train launch slurm` on a login "
            "node of the cluster (where sbatch, squeue and scontrol are), or install SLURM's client commands."
        ) from None


def _fields(line: str) -> dict[str, str]:
    """`scontrol show -o` output as a dict (values without spaces: the ones read here)."""
    return dict(re.findall(r"(\w+)=(\S*)", line))


def job_name(prepared: PreparedLaunch) -> str:
    """The SLURM job name of a launched run: the same for every launch of the run."""
    return f"lm-train-{prepared.run_id}"


@dataclass
class _Job:
    """The job being followed: its id, the restarts SLURM reported when this start began, and whether it ran."""

    job_id: str
    restarts: int
    running: bool = False


class SlurmBackend:
    """Runs a prepared launch as one SLURM batch job of `hosts` nodes, one task per node."""

    name = "slurm"

    def __init__(
        self,
        *,
        partition: str | None = None,
        time_limit: str | None = None,
        sbatch_args: tuple[str, ...] = (),
        python: str = sys.executable,
        finish_wait_s: int = 120,
        poll_s: float = 1.0,
        requeue_grace_s: float = 10.0,
    ) -> None:
        self.partition = partition
        self.time_limit = time_limit
        self.sbatch_args = sbatch_args
        self.python = python
        self.finish_wait_s = finish_wait_s
        self.poll_s = poll_s
        self.requeue_grace_s = requeue_grace_s
        self._job: _Job | None = None
        self._slurm_job: SlurmJob | None = None
        self._offset = 0

    # -- the cluster -----------------------------------------------------------------------------------------

    def check_partition(self) -> str:
        """The partition the job goes to (--partition, else the cluster's default); a clear error when SLURM
        has no such partition or cannot be reached."""
        done = _run(["sinfo", "-h", "-o", "%P"])
        if done.returncode != 0:
            raise LaunchError(
                f"SLURM's controller did not answer `sinfo`: {done.stderr.strip() or done.returncode}. Check that "
                "slurmctld runs and that this machine's slurm.conf (or $SLURM_CONF) points at it."
            )
        names = [p.strip() for p in done.stdout.split()]
        plain = [p.rstrip("*") for p in names]
        if self.partition is None:
            default = [p.rstrip("*") for p in names if p.endswith("*")]
            if not default:
                raise LaunchError(
                    f"SLURM has no default partition; pass --partition (its partitions: {', '.join(plain)})."
                )
            return default[0]
        if self.partition not in plain:
            raise LaunchError(
                f"SLURM has no partition {self.partition!r} (--partition); its partitions are: "
                f"{', '.join(plain) or 'none'}. Pass one of them (`sinfo` lists them with their nodes)."
            )
        return self.partition

    def hosts_available(self) -> int:
        """Nodes of the partition that are up (idle, in use or completing), whether or not another job holds them."""
        partition = self.check_partition()
        done = _run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t"])
        nodes = {}
        for line in done.stdout.splitlines():
            name, _, state = line.strip().partition(" ")
            nodes[name] = state.strip().rstrip("*~#!%$@^-+").lower()
        return sum(1 for state in nodes.values() if state in USABLE)

    def check_no_job_of(self, prepared: PreparedLaunch) -> None:
        """A clear error when a job of this run is still queued or running (a launcher that was killed leaves its
        job behind): two jobs of one run would write the same checkpoints."""
        done = _run(["squeue", "-h", "-n", job_name(prepared), "-o", "%i %T"])
        active = [line.split() for line in done.stdout.splitlines() if line.strip()]
        if active:
            jobs = ", ".join(f"{job_id} ({state})" for job_id, state, *_ in active)
            raise LaunchError(
                f"Run {prepared.run_id} already has SLURM job {jobs} queued or running (`squeue -n "
                f"{job_name(prepared)}`). Wait for it to end, or cancel it (`scancel {active[0][0]}`), then launch "
                "again: it resumes from the newest intact checkpoint."
            )

    # -- one start -------------------------------------------------------------------------------------------

    def prepare_job(self, prepared: PreparedLaunch, hosts: int, job_dir: Path) -> tuple[SlurmJob, str]:
        """The job's description and its sbatch script (written nowhere yet)."""
        job = SlurmJob(hosts, job_dir, self.partition, self.time_limit, self.python, self.finish_wait_s)
        return job, batch_script(prepared, job, job_name(prepared))

    def _submit(self, prepared: PreparedLaunch, hosts: int, log: LaunchLog) -> _Job:
        if self._slurm_job is None or self._slurm_job.hosts != hosts:
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
            job, script = self.prepare_job(prepared, hosts, prepared.run_dir / "slurm" / f"launch-{stamp}")
            # Every node reads the code from the shared file system (the run directory's): no copy per node.
            shutil.copytree(prepared.workdir, job.code_dir, symlinks=True)
            (job.job_dir / "job.sbatch").write_text(script, encoding="utf-8")
            self._slurm_job, self._offset = job, 0
        job = self._slurm_job
        done = _run(["sbatch", "--parsable", *self.sbatch_args, str(job.job_dir / "job.sbatch")])
        if done.returncode != 0:
            raise LaunchError(
                f"sbatch refused the job of run {prepared.run_id}: {done.stderr.strip()}. Its script is "
                f"{job.job_dir / 'job.sbatch'}; fix the cause (the partition, --time, --sbatch-arg) and launch again."
            )
        job_id = done.stdout.strip().split(";")[0]
        log.event("submitted", f"submitted SLURM job {job_id}", job_id=job_id, script=str(job.job_dir / "job.sbatch"))
        return _Job(job_id, 0)

    def _state(self, job_id: str) -> dict[str, str]:
        """JobState, Restarts, ExitCode, NodeList, Reason... of the job; from sacct once scontrol forgot it."""
        done = _run(["scontrol", "show", "job", "-o", job_id])
        if done.returncode == 0 and done.stdout.strip():
            return _fields(done.stdout)
        done = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,NodeList"])
        if done.returncode == 0 and done.stdout.strip():
            state, exit_code, nodes = done.stdout.strip().splitlines()[-1].split("|")[:3]
            return {"JobState": state.split()[0], "ExitCode": exit_code, "NodeList": nodes, "Restarts": "-1"}
        return {"JobState": "UNKNOWN"}

    def run_once(self, prepared: PreparedLaunch, hosts: int, attempt: int, log: LaunchLog) -> Outcome:
        if self._job is None:
            self._job = self._submit(prepared, hosts, log)
        job = self._job
        while True:
            fields = self._state(job.job_id)
            self._stream()
            state, restarts = fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", "0"))
            if restarts > job.restarts:
                job.restarts, job.running = restarts, False
                return Outcome(1, f"SLURM requeued job {job.job_id} (restart {restarts}; it was {state})")
            if state == "RUNNING" and not job.running:
                job.running = True
                self._started(job, fields, attempt, log)
            elif state in ENDED:
                return self._ended(job, fields, attempt, log)
            elif state == "UNKNOWN":
                self._job = None
                return Outcome(1, f"SLURM no longer knows job {job.job_id} (scontrol and sacct)", False)
            time.sleep(self.poll_s)

    def _started(self, job: _Job, fields: dict[str, str], attempt: int, log: LaunchLog) -> None:
        nodes = fields.get("NodeList", "")
        log.event(
            "processes",
            f"SLURM job {job.job_id} runs on {nodes}; process 0's console follows",
            attempt=attempt,
            job_id=job.job_id,
            nodes=nodes,
            restarts=job.restarts,
            workdir=str(self._slurm_job.code_dir) if self._slurm_job else None,
        )

    def _ended(self, job: _Job, fields: dict[str, str], attempt: int, log: LaunchLog) -> Outcome:
        state = fields["JobState"]
        if state in MAYBE_REQUEUED and fields.get("Requeue") == "1":
            deadline = time.monotonic() + self.requeue_grace_s
            while time.monotonic() < deadline:  # SLURM requeues a requeueable job a moment after the event
                time.sleep(self.poll_s)
                later = self._state(job.job_id)
                if int(later.get("Restarts", "0")) > job.restarts:
                    job.restarts, job.running = int(later["Restarts"]), False
                    return Outcome(1, f"SLURM requeued job {job.job_id} after {state}")
        self._stream()
        self._job = None  # the next start, if any, submits the job again
        code = fields.get("ExitCode", "0:0").split(":")
        status = int(code[0]) if code[0].isdigit() else 1
        statuses = self._statuses()
        where = f"SLURM job {job.job_id} ended {state}"
        if state == "COMPLETED":
            return Outcome(0, "")
        if statuses.get(0) == 0:
            # Process 0 finished the run; srun stopped the others after --wait (finish_wait_s).
            stopped = sorted(i for i in range(self._slurm_job.hosts) if statuses.get(i) != 0)
            log.event(
                "stragglers_stopped",
                f"process 0 finished, but process(es) {stopped} had not exited {self.finish_wait_s} s later: "
                "srun stopped them",
                attempt=attempt,
                processes=stopped,
            )
            return Outcome(0, "")
        if state == "CANCELLED":
            return Outcome(status or 1, f"{where} (cancelled by `scancel` or an administrator)", False)
        failed = {i: s for i, s in statuses.items() if s != 0}
        detail = f" (process exit statuses {failed})" if failed else ""
        if BAD_INPUT_STATUS in failed.values():
            return Outcome(BAD_INPUT_STATUS, f"{where}{detail}, lm-train's status for bad input", False)
        self._print_tail(job)
        return Outcome(status or 1, f"{where}{detail}")

    def _statuses(self) -> dict[int, int]:
        """Each process's exit status, as its task wrote it (a process stopped by a signal writes none)."""
        found: dict[int, int] = {}
        if self._slurm_job is None:
            return found
        for path in sorted(self._slurm_job.job_dir.glob(f"{STATUS_PREFIX}*")):
            text = path.read_text(encoding="utf-8").strip()
            if path.name[len(STATUS_PREFIX) :].isdigit() and text.lstrip("-").isdigit():
                found[int(path.name[len(STATUS_PREFIX) :])] = int(text)
        return found

    def _stream(self) -> None:
        """Print what process 0 wrote since the last call."""
        if self._slurm_job is None:
            return
        path = self._slurm_job.process_log(0)
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        if data:
            self._offset += len(data)
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()

    def _print_tail(self, job: _Job) -> None:
        """SLURM's own lines about the job (srun's errors), for the cause of a failure."""
        assert self._slurm_job is not None
        path = self._slurm_job.job_dir / f"slurm-{job.job_id}.out"
        if path.exists():
            last = "\n".join(path.read_text(errors="replace").splitlines()[-8:])
            print(f"launch: the last lines of {path}:\n{last}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Cancel the job if the launcher leaves before it ended (restarts spent, Ctrl-C): the launcher owns it."""
        if self._job is None:
            return
        state = self._state(self._job.job_id).get("JobState", "UNKNOWN")
        if state not in ENDED and state != "UNKNOWN":
            _run(["scancel", self._job.job_id])
            print(f"launch: cancelled SLURM job {self._job.job_id} ({state})", file=sys.stderr, flush=True)
        self._job = None
