"""The SLURM backend: the prepared launch copied to the shared file system, submitted with sbatch, followed with
scontrol (sacct once the controller has forgotten the job), process 0's console streamed from its log file.

A start is one run of the job's script: a requeue by SLURM (preemption, a failed node, `scontrol requeue`) ends a
start and the next follows the same job; a job that ended (preempted, node failure, time limit, a failed process)
is submitted again. A restart on fewer nodes (--min-hosts) cancels a requeued job and submits a smaller one."""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.slurm_commands import (
    check_no_job_of,
    checked_partition,
    job_name,
    job_state,
    nodes_free,
    nodes_up,
    run,
)
from lm_train.launch.slurm_script import STATUS_PREFIX, SlurmJob, batch_script
from lm_train.launch.snapshot import LaunchError
from lm_train.launch.supervise import BAD_INPUT_STATUS, LaunchLog, Outcome

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}
ENDED |= {"OUT_OF_MEMORY"}
MAYBE_REQUEUED = {"PREEMPTED", "NODE_FAIL"}
"""Ends after which SLURM itself may requeue a requeueable job a moment later."""


@dataclass
class _Job:
    """The job being followed: its id, the restarts SLURM reported when this start began, and whether it ran."""

    job_id: str
    restarts: int
    running: bool = False


class SlurmBackend:
    """Runs a prepared launch as one SLURM batch job of `hosts` nodes, `tasks_per_node` processes on each."""

    name = "slurm"
    queues = True
    """SLURM keeps a job pending until its nodes are up: a restart with too few nodes up waits in its queue."""

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
        tasks_per_node: int = 1,
    ) -> None:
        self.partition = partition
        self.time_limit = time_limit
        self.sbatch_args = sbatch_args
        self.python = python
        self.finish_wait_s = finish_wait_s
        self.poll_s = poll_s
        self.requeue_grace_s = requeue_grace_s
        self.tasks_per_node = tasks_per_node
        self._job: _Job | None = None
        self._slurm_job: SlurmJob | None = None
        self._offset = 0
        self._pending_reason: str | None = None

    # -- the cluster -----------------------------------------------------------------------------------------

    def check_partition(self) -> str:
        """The partition the job goes to; a clear error when SLURM has no such partition or cannot be reached."""
        return checked_partition(self.partition)

    def hosts_available(self) -> int:
        """Nodes of the partition that are up, whether or not another job holds them."""
        return nodes_up(self.check_partition())

    def hosts_free(self) -> int:
        """Nodes of the partition that no job holds, or with a CPU idle for each task of this one."""
        return nodes_free(self.check_partition(), self.tasks_per_node)

    def check_no_job_of(self, prepared: PreparedLaunch) -> None:
        """A clear error when a job of this run is still queued or running."""
        check_no_job_of(prepared)

    # -- one start -------------------------------------------------------------------------------------------

    def prepare_job(self, prepared: PreparedLaunch, hosts: int, job_dir: Path) -> tuple[SlurmJob, str]:
        """The job's description and its sbatch script (written nowhere yet)."""
        job = SlurmJob(
            hosts, job_dir, self.partition, self.time_limit, self.python, self.finish_wait_s, self.tasks_per_node
        )
        return job, batch_script(prepared, job, job_name(prepared))

    def _submit(self, prepared: PreparedLaunch, hosts: int, log: LaunchLog) -> _Job:
        if self._slurm_job is None or self._slurm_job.hosts != hosts:
            stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
            job_dir = prepared.run_dir / "slurm" / f"launch-{stamp}"
            if job_dir.exists():  # a resubmission on fewer nodes within the same second
                job_dir = job_dir.with_name(f"{job_dir.name}-{hosts}")
            job, script = self.prepare_job(prepared, hosts, job_dir)
            # Every node reads the code from the shared file system (the run directory's): no copy per node.
            shutil.copytree(prepared.workdir, job.code_dir, symlinks=True)
            (job.job_dir / "job.sbatch").write_text(script, encoding="utf-8")
            self._slurm_job, self._offset = job, 0
        job = self._slurm_job
        done = run(["sbatch", "--parsable", *self.sbatch_args, str(job.job_dir / "job.sbatch")])
        if done.returncode != 0:
            raise LaunchError(
                f"sbatch refused the job of run {prepared.run_id}: {done.stderr.strip()}. Its script is "
                f"{job.job_dir / 'job.sbatch'}; fix the cause (the partition, --time, --sbatch-arg) and launch again."
            )
        job_id = done.stdout.strip().split(";")[0]
        log.event("submitted", f"submitted SLURM job {job_id}", job_id=job_id, script=str(job.job_dir / "job.sbatch"))
        return _Job(job_id, 0)

    def run_once(self, prepared: PreparedLaunch, hosts: int, attempt: int, log: LaunchLog) -> Outcome:
        if self._job is not None and self._slurm_job is not None and self._slurm_job.hosts != hosts:
            self._cancel_for_fewer_hosts(hosts, attempt, log)
        if self._job is None:
            self._job = self._submit(prepared, hosts, log)
        job = self._job
        while True:
            fields = job_state(job.job_id)
            self._stream()
            state, restarts = fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", "0"))
            if state == "PENDING":
                self._pending(job, fields.get("Reason", ""))
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

    def _cancel_for_fewer_hosts(self, hosts: int, attempt: int, log: LaunchLog) -> None:
        """Cancel the requeued job, which would wait for nodes that are gone, so that one of `hosts` nodes
        replaces it."""
        assert self._job is not None and self._slurm_job is not None
        job_id, before = self._job.job_id, self._slurm_job.hosts
        run(["scancel", job_id])
        # The new job has the same name: the old one must be gone from the queue first (an instant, for a
        # pending job; a completing one's processes are being stopped).
        deadline = time.monotonic() + 60
        while job_state(job_id).get("JobState", "UNKNOWN") not in ENDED | {"UNKNOWN"}:
            if time.monotonic() > deadline:
                break
            time.sleep(self.poll_s)
        log.event(
            "resized",
            f"cancelled the requeued SLURM job {job_id} of {before} nodes: submitting one of {hosts} (--min-hosts)",
            attempt=attempt,
            job_id=job_id,
            hosts_before=before,
            hosts=hosts,
        )
        self._job = None

    def _pending(self, job: _Job, reason: str) -> None:
        """Say on the console why the job waits, each time SLURM gives a new reason (nodes down or busy, a
        requeue's hold); launch.jsonl keeps only what the launcher did."""
        if reason in (self._pending_reason, "", "None"):
            return
        self._pending_reason = reason
        print(f"launch: SLURM job {job.job_id} is pending ({reason.replace('_', ' ')})", file=sys.stderr, flush=True)

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
                later = job_state(job.job_id)
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
            assert self._slurm_job is not None  # set when the job was submitted, and kept
            stopped = sorted(i for i in range(self._slurm_job.processes) if statuses.get(i) != 0)
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
        state = job_state(self._job.job_id).get("JobState", "UNKNOWN")
        if state not in ENDED and state != "UNKNOWN":
            run(["scancel", self._job.job_id])
            print(f"launch: cancelled SLURM job {self._job.job_id} ({state})", file=sys.stderr, flush=True)
        self._job = None
