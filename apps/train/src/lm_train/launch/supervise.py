"""Keeping a launched run alive on any backend: start it, and after a lost host start it again (a restart is a
rerun: the run resumes from its newest intact checkpoint), each start and its cause in <run_dir>/launch.jsonl."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.snapshot import LaunchError

BAD_INPUT_STATUS = 2
"""lm-train's exit status for bad input (a config or data error): restarting cannot help."""


@dataclass(frozen=True)
class Outcome:
    """How one start of the job ended."""

    exit_status: int
    cause: str
    """What happened, in a sentence (empty when every process finished)."""
    restartable: bool = True


class Backend(Protocol):
    """An engine that runs one prepared launch on its hosts: Ray today; SLURM and TPU VMs plug in the same way."""

    name: str
    queues: bool
    """Whether the engine keeps a job waiting until its hosts are up (SLURM), rather than refusing it (Ray)."""

    def hosts_available(self) -> int:
        """How many hosts the engine could start a process on now."""
        ...

    def hosts_free(self) -> int:
        """How many of them no other job holds now (what a first start with --min-hosts waits for)."""
        ...

    def run_once(self, prepared: PreparedLaunch, hosts: int, attempt: int, log: LaunchLog) -> Outcome:
        """Start one process per host, stream process 0's console, and return once the job ended or lost a host
        (having stopped the survivors)."""
        ...


class LaunchLog:
    """<run_dir>/launch.jsonl (one JSON object per event, with its UTC time) and the same line on the console."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "launch.jsonl"

    def event(self, event: str, message: str, **fields: Any) -> None:
        """Append one event and print `message`."""
        row = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event, **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"launch: {message}", file=sys.stderr, flush=True)


def _hosts_for_restart(backend: Backend, wanted: int, minimum: int, wait_s: float) -> tuple[int, int]:
    """(the hosts to restart on, the hosts up): `wanted` if the cluster has them within `wait_s`, else as many as
    it has, when at least `minimum`; when not even that many are there, `minimum` for an engine that queues the job
    until they are back, else 0."""
    deadline = time.monotonic() + wait_s
    while True:
        available = backend.hosts_available()
        if available >= wanted:
            return wanted, available
        if time.monotonic() >= deadline:
            if available >= minimum:
                return available, available
            return (minimum if backend.queues else 0), available
        time.sleep(min(2.0, max(deadline - time.monotonic(), 0.1)))


def _hosts_at_start(backend: Backend, wanted: int, minimum: int, wait_s: float) -> tuple[int, float]:
    """(the hosts to start on, the seconds waited for them): `wanted` once that many are free within `wait_s`, else
    as many as are free then, when at least `minimum`; a clear error when fewer (nothing started or written)."""
    started = time.monotonic()
    free = backend.hosts_free()
    if free >= wanted:
        return wanted, 0.0
    print(
        f"launch: the {backend.name} cluster has {free} host(s) free, fewer than --hosts {wanted}: waiting up to "
        f"{wait_s:.0f} s (--wait-for-hosts) for more",
        file=sys.stderr,
        flush=True,
    )
    while free < wanted and time.monotonic() - started < wait_s:
        time.sleep(min(1.0, max(wait_s - (time.monotonic() - started), 0.05)))
        free = backend.hosts_free()
    waited = time.monotonic() - started
    if free >= minimum:
        return min(free, wanted), waited
    raise LaunchError(
        f"The {backend.name} cluster had {free} host(s) free after waiting {waited:.0f} s (--wait-for-hosts), fewer "
        f"than --min-hosts {minimum}: nothing was started. Free or add nodes (`sinfo` or `ray status` shows what "
        "holds them), or lower --min-hosts, or wait longer with --wait-for-hosts; then launch again."
    )


def supervise(
    prepared: PreparedLaunch,
    backend: Backend,
    *,
    hosts: int,
    min_hosts: int,
    max_restarts: int,
    wait_for_hosts_s: float = 60.0,
    wait_at_start: bool = False,
) -> int:
    """Run the job to its end, restarting it after each lost host up to `max_restarts` times; its exit status.
    With `wait_at_start` (an explicit --min-hosts) the first start waits `wait_for_hosts_s` for `hosts` free hosts
    and starts on as few as `min_hosts`; without, fewer hosts alive than `hosts` are refused at once."""
    count, waited = hosts, 0.0
    if wait_at_start:
        count, waited = _hosts_at_start(backend, hosts, min_hosts, wait_for_hosts_s)
    elif (available := backend.hosts_available()) < hosts:
        raise LaunchError(
            f"The {backend.name} cluster has {available} node{'s' * (available != 1)} alive, fewer than --hosts "
            f"{hosts} (one training process per node). Add nodes to the cluster, or launch with --hosts "
            f"{available}{' or fewer' if available > 1 else ''}."
        )
    prepared.claim_run_id()
    log = LaunchLog(prepared.run_dir)
    record = prepared.record
    cause = "first start"
    # How long the first start waited for free hosts (--min-hosts), in its line of launch.jsonl.
    waited_field = {"waited_for_hosts_s": round(waited, 1)} if waited else {}
    for attempt in range(max_restarts + 1):
        log.event(
            "start" if attempt == 0 else "restart",
            f"{'starting' if attempt == 0 else 'restarting'} run {prepared.run_id} on {count} hosts "
            f"(attempt {attempt + 1} of at most {max_restarts + 1}; cause: {cause})",
            attempt=attempt,
            hosts=count,
            cause=cause,
            run_id=prepared.run_id,
            backend=backend.name,
            commit=record.commit,
            diff_sha256=record.diff_sha256,
            **(waited_field if attempt == 0 else {}),
        )
        outcome = backend.run_once(prepared, count, attempt, log)
        if outcome.exit_status == 0:
            log.event("finished", f"run {prepared.run_id} finished", attempt=attempt, exit_status=0)
            return 0
        log.event("failed", outcome.cause, attempt=attempt, exit_status=outcome.exit_status, cause=outcome.cause)
        if not outcome.restartable:
            return outcome.exit_status
        if attempt == max_restarts:
            break
        cause = outcome.cause
        count, available = _hosts_for_restart(backend, hosts, min_hosts, wait_for_hosts_s)
        if count > available:
            log.event(
                "waiting_for_hosts",
                f"the {backend.name} cluster has {available} host(s) up, fewer than the {count} to restart on: the "
                f"job waits in {backend.name}'s queue until they are back",
                attempt=attempt,
                hosts_up=available,
                hosts=count,
            )
        if count == 0:
            log.event("gave_up", "too few hosts to restart on", attempt=attempt, cause=cause)
            raise LaunchError(
                f"Run {prepared.run_id} lost a host ({cause}) and the cluster has fewer than the {min_hosts} "
                f"node(s) needed to restart it (--min-hosts) after waiting {wait_for_hosts_s:.0f} s. Its checkpoints "
                f"are as they were: add nodes, then run the same `lm-train launch` command again to resume (or "
                "lower --min-hosts)."
            )
    log.event("gave_up", "restarts exhausted", attempt=max_restarts, cause=outcome.cause)
    raise LaunchError(
        f"Run {prepared.run_id} failed {max_restarts + 1} time(s), --max-restarts {max_restarts} being spent; the "
        f"last failure: {outcome.cause}. Every start and its cause is in {log.path}. Its checkpoints are as they "
        "were: fix the cause, then run the same `lm-train launch` command again to resume from the newest intact "
        "one (or allow more restarts with --max-restarts)."
    )
