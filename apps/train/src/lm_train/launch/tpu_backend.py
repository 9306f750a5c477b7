"""The TPU VM backend: the shipped folder copied to every worker, one gcloud ssh session per worker running its
`lm-train run`, watched; when a worker's process fails or its session is lost, the others are stopped and
supervise() starts the job again (it resumes from its newest intact checkpoint)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.supervise import BAD_INPUT_STATUS, LaunchLog, Outcome
from lm_train.launch.tpu_commands import (
    TpuTarget,
    check_gcloud,
    copy_lines,
    describe_line,
    run_commands,
    start_line,
    stop_line,
)

SSH_LOST = 255
"""ssh's own exit status when the connection failed or dropped: the worker went away (a preempted or restarted VM)."""


def decide(exits: dict[int, int], workers: int) -> Outcome | None:
    """How the job ended, from the exit statuses of the workers' sessions that ended so far (worker -> status);
    None while it goes on."""
    if exits.get(0) == 0:
        return Outcome(0, "")  # process 0 exits 0 only after the run's last save: the others are stopped
    failed = {worker: status for worker, status in sorted(exits.items()) if status != 0}
    if not failed:
        return Outcome(0, "") if len(exits) == workers else None
    if BAD_INPUT_STATUS in failed.values():
        worker = next(w for w, s in failed.items() if s == BAD_INPUT_STATUS)
        return Outcome(
            BAD_INPUT_STATUS,
            f"the training process of worker {worker} exited with lm-train's status for bad input: a restart cannot "
            "fix it",
            False,
        )
    worker, status = next(iter(failed.items()))
    if status == SSH_LOST:
        return Outcome(
            status,
            f"the ssh session to worker {worker} was lost (status 255): the TPU VM was "
            "preempted, restarted or unreachable",
        )
    if status < 0:
        return Outcome(status, f"the ssh session to worker {worker} was killed by signal {-status} on this machine")
    return Outcome(status, f"the training process of worker {worker} exited with status {status}")


class TpuBackend:
    """Runs a prepared launch on every worker of one Cloud TPU VM (a slice: all its workers, or none)."""

    name = "tpu"
    queues = False

    def __init__(self, target: TpuTarget, *, poll_s: float = 1.0) -> None:
        self.target = target
        self.poll_s = poll_s
        self.describe_error = ""
        """gcloud's last line when the VM could not be described (no such VM, no credentials), for the error."""

    def hosts_available(self) -> int:
        """The VM's workers when it is READY, else 0 (preempted, restarting, being repaired)."""
        check_gcloud()
        done = subprocess.run(describe_line(self.target), capture_output=True, text=True, check=False, timeout=120)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            self.describe_error = next((x for x in lines if x.startswith("ERROR")), f"exit status {done.returncode}")
            return 0
        vm = json.loads(done.stdout or "{}")
        return len(vm.get("networkEndpoints", [])) if vm.get("state") == "READY" else 0

    def hosts_free(self) -> int:
        """The VM's workers when it is READY: the VM is this run's alone."""
        return self.hosts_available()

    def run_once(self, prepared: PreparedLaunch, hosts: int, attempt: int, log: LaunchLog) -> Outcome:
        status = run_commands(copy_lines(prepared, self.target))
        if status != 0:
            return Outcome(status, f"copying the code to the workers failed (gcloud exited with status {status})")
        logs = Path(prepared.run_dir) / "tpu"
        logs.mkdir(parents=True, exist_ok=True)
        sessions: dict[int, subprocess.Popen] = {}
        try:
            for worker in range(hosts):
                # Worker 0's console is streamed to this one; the others' go to <run_dir>/tpu/worker-N.log.
                out = None if worker == 0 else open(logs / f"worker-{worker}.log", "ab")  # noqa: SIM115
                line = start_line(prepared, self.target, worker)
                sessions[worker] = subprocess.Popen(
                    line, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
                if out is not None:
                    out.close()  # the session has its own copy
            log.event(
                "processes",
                f"{hosts} workers started; worker 0's console follows",
                attempt=attempt,
                workers=hosts,
                logs=str(logs),
            )
            exits: dict[int, int] = {}
            while (outcome := decide(exits, hosts)) is None:
                time.sleep(self.poll_s)
                exits.update({w: s.returncode for w, s in sessions.items() if s.poll() is not None})
            return outcome
        finally:
            self._stop(prepared, sessions)

    def _stop(self, prepared: PreparedLaunch, sessions: dict[int, subprocess.Popen]) -> None:
        """Stop the run's process on every worker, then the sessions still open."""
        if any(s.poll() is None for s in sessions.values()):
            print("launch: stopping the training processes on every worker", file=sys.stderr, flush=True)
            try:  # a lost worker may leave its part of the line hanging: the sessions below are closed anyway
                subprocess.run(stop_line(prepared, self.target), check=False, timeout=300)
            except subprocess.TimeoutExpired:
                print("launch: the stop line did not return within 300 s", file=sys.stderr, flush=True)
        for session in sessions.values():
            if session.poll() is None:
                session.terminate()
            session.wait()
