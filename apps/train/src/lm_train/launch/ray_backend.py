"""The Ray backend: one training process per node of an existing Ray cluster, placed by a STRICT_SPREAD placement
group, the code shipped as the job's runtime_env working_dir, each host watched through its actor's answers."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from typing import Any, cast

from lm_train.launch.prepared import PreparedLaunch
from lm_train.launch.snapshot import LaunchError
from lm_train.launch.supervise import BAD_INPUT_STATUS, LaunchLog, Outcome

TOKEN_MEMORY = 1 << 20
"""A bundle's reservation when it takes no CPU: Ray refuses an empty bundle, and every node offers `memory`."""


def _split_address(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A clear error at once when nothing answers at host:port (Ray itself would retry for a minute or more)."""
    parts = _split_address(address)
    if parts is None:
        return  # `auto` or a ray:// client address: ray.init says what is wrong with it
    try:
        socket.create_connection(parts, timeout=timeout_s).close()
    except OSError as e:
        raise LaunchError(
            f"Cannot reach the Ray cluster at {address} (--address, else $RAY_ADDRESS): {e.strerror or e}. Start "
            "one (`ray start --head --port 6379` on the head node, `ray start --address HEAD:6379` on the others), "
            "or give the address that `ray status` prints on the head node."
        ) from None


def _status_text(status: int) -> str:
    if status < 0:
        with_name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        return f"was killed by {with_name}"
    return f"exited with status {status}"


class RayBackend:
    """Runs a prepared launch on the Ray cluster at `address`."""

    name = "ray"
    queues = False

    def __init__(
        self,
        address: str,
        *,
        cpus_per_host: float = 0.0,
        heartbeat_timeout_s: float = 60.0,
        poll_wait_s: float = 5.0,
        stop_grace_s: float = 10.0,
        placement_timeout_s: float = 60.0,
        finish_wait_s: float = 120.0,
        tasks_per_node: int = 1,
    ) -> None:
        self.address = address
        self.cpus_per_host = cpus_per_host
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.poll_wait_s = min(poll_wait_s, heartbeat_timeout_s / 4)
        """How long a host's answer may wait for news (its process's exit, process 0's console): the launcher
        blocks on the answers instead of polling, and a host that does not answer within the heartbeat is lost."""
        self.stop_grace_s = stop_grace_s
        self.placement_timeout_s = placement_timeout_s
        self.finish_wait_s = finish_wait_s
        """Once process 0 has finished, how long the others get to exit before they are stopped."""
        self.tasks_per_node = tasks_per_node
        """Training processes per node: process id = node's bundle index * tasks_per_node + local index."""

    def connect(self, prepared: PreparedLaunch) -> None:
        """Join the cluster as a driver whose job ships the prepared folder to every node that runs its actors."""
        check_reachable(self.address)
        # Under `uv run`, Ray would otherwise ship the whole workspace (.venv included) instead of working_dir.
        os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        try:
            ray.init(
                address=self.address,
                runtime_env={"working_dir": str(prepared.workdir)},
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise LaunchError(
                f"Joining the Ray cluster at {self.address} failed: {str(e).strip().rstrip('.')}. Check that the "
                "address is the head's GCS (host:6379, as `ray status` shows it) and that this machine runs the "
                "cluster's Ray version."
            ) from None

    def close(self) -> None:
        import ray

        ray.shutdown()

    def hosts_available(self) -> int:
        import ray

        return sum(1 for node in ray.nodes() if node.get("Alive"))

    def hosts_free(self) -> int:
        """The nodes alive: Ray places the bundles, and says so when it cannot (a failed start, restarted)."""
        return self.hosts_available()

    def _bundle(self) -> dict[str, float]:
        # The training process's CPU use is its own; reserving a node's CPUs here would starve the cache build's
        # Ray tasks on the same cluster, which a process of the run starts. Reserve only what is asked for.
        if self.cpus_per_host > 0:
            return {"CPU": self.cpus_per_host}
        return {"memory": TOKEN_MEMORY * self.tasks_per_node}

    def run_once(self, prepared: PreparedLaunch, hosts: int, attempt: int, log: LaunchLog) -> Outcome:
        import ray.exceptions  # binds `ray` too
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from lm_train.launch.ray_host import HostProcess

        group = placement_group([self._bundle()] * hosts, strategy="STRICT_SPREAD", name=f"lm-train-{prepared.run_id}")
        actors: list[Any] = []
        self._lost: set[str] = set()
        try:
            try:
                ray.get(group.ready(), timeout=self.placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                return Outcome(
                    1,
                    f"Ray could not place one process on each of {hosts} distinct nodes (STRICT_SPREAD, "
                    f"{self._bundle()} each) within {self.placement_timeout_s:.0f} s",
                )
            remote = ray.remote(HostProcess)
            # An actor asks for 1 CPU to be created unless told otherwise: the node's actors must fit its bundle.
            resources: dict[str, Any] = {"num_cpus": self.cpus_per_host / self.tasks_per_node}
            if self.cpus_per_host == 0:
                resources["memory"] = TOKEN_MEMORY
            for index in range(hosts * self.tasks_per_node):
                bundle = index // self.tasks_per_node  # process ids go node by node
                strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
                actors.append(
                    # One thread: a stop or tail waits for a poll's answer (at most poll_wait_s).
                    remote.options(scheduling_strategy=strategy, max_restarts=0, **resources).remote()  # type: ignore[attr-defined]
                )
            return self._run_actors(prepared, actors, attempt, log)
        finally:
            self._stop(actors)
            remove_placement_group(group)
            if self._lost:
                self._wait_until_dead(self._lost)

    def _run_actors(self, prepared: PreparedLaunch, actors: list[Any], attempt: int, log: LaunchLog) -> Outcome:
        import ray.exceptions  # binds `ray` too

        from lm_train.launch.ray_host import remote_cause

        try:
            hosts = ray.get([a.describe.remote(i == 0) for i, a in enumerate(actors)], timeout=self.placement_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            return Outcome(1, f"a host's actor did not start: {type(e).__name__}")
        except ray.exceptions.RayTaskError as e:  # a host that cannot run the process: restarted, like a lost one
            return Outcome(1, f"a host's actor failed: {remote_cause(e)}")
        coordinator = f"{hosts[0]['ip']}:{hosts[0]['port']}"
        # Cache builds of the run join this cluster instead of starting one of their own.
        gcs = ray.get_runtime_context().gcs_address
        starts = []
        for i, (actor, host) in enumerate(zip(actors, hosts, strict=True)):
            local = (i % self.tasks_per_node, self.tasks_per_node)
            env = {**prepared.process_env(host["workdir"], i, len(actors), coordinator, local), "RAY_ADDRESS": gcs}
            env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
            starts.append(
                actor.start.remote(
                    prepared.argv(sys.executable, host["workdir"]), env, prepared.process_cwd(host["workdir"])
                )
            )
        try:
            pids = ray.get(starts, timeout=self.placement_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            return Outcome(1, f"a host's process did not start: {type(e).__name__}")
        except ray.exceptions.RayTaskError as e:
            return Outcome(1, f"a host's process did not start: {remote_cause(e)}")
        processes = [
            {"process": i, "node_id": h["node_id"], "ip": h["ip"], "pid": pid}
            for i, (h, pid) in enumerate(zip(hosts, pids, strict=True))
        ]
        log.event(
            "processes",
            f"{len(actors)} processes started, coordinator {coordinator}; process 0's console follows",
            attempt=attempt,
            coordinator=coordinator,
            processes=processes,
            workdir=hosts[0]["workdir"],
        )
        return self._watch(actors, hosts, log, attempt)

    def _watch(self, actors: list[Any], hosts: list[dict[str, Any]], log: LaunchLog, attempt: int) -> Outcome:
        """Follow every host until all exit, one fails, or one is lost (its actor dies or stops answering)."""
        import ray.exceptions  # binds `ray` too

        offset, wait = 0, self.poll_wait_s
        pending = {i: a.poll.remote(0 if i == 0 else None, wait) for i, a in enumerate(actors)}
        answered = dict.fromkeys(pending, time.monotonic())
        statuses: dict[int, int] = {}
        finished_at: float | None = None  # when process 0 exited with status 0
        while pending:
            # Blocks until some host answers: each answers within `wait` (at once when there is news), so the
            # launcher sleeps while the run trains (an immediate answer, polled in a loop, took half a CPU).
            refs = list(pending.values())
            ready, _ = ray.wait(refs, num_returns=1, timeout=wait + 1.0)
            if ready:  # with the others that answered meanwhile
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            now = time.monotonic()
            if finished_at is not None and now - finished_at > self.finish_wait_s:
                # The run is done (process 0 exits 0 only after the last save); a process that hangs in its exit
                # must not hold the launcher for ever. run_once stops it.
                late = sorted(pending)
                log.event(
                    "stragglers_stopped",
                    f"process 0 finished, but process(es) {late} had not exited {self.finish_wait_s:.0f} s later: "
                    "stopping them",
                    attempt=attempt,
                    processes=late,
                )
                return Outcome(0, "")
            for i, ref in list(pending.items()):
                label = f"host {i}" if self.tasks_per_node == 1 else f"process {i}"
                where = f"{label} (node {hosts[i]['node_id'][:12]}, {hosts[i]['ip']})"
                if ref not in ready:
                    if now - answered[i] > self.heartbeat_timeout_s:
                        self._lost.add(hosts[i]["node_id"])
                        return Outcome(1, f"{where} sent no heartbeat for {self.heartbeat_timeout_s:.0f} s")
                    continue
                try:
                    data, next_offset, status = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._lost.add(hosts[i]["node_id"])
                    return Outcome(1, f"{where} was lost: its Ray actor died ({type(e).__name__})")
                answered[i] = now
                if i == 0 and data:
                    sys.stdout.write(data.decode(errors="replace"))
                    sys.stdout.flush()
                    offset = next_offset
                if status is None:
                    pending[i] = actors[i].poll.remote(offset if i == 0 else None, wait)
                    continue
                del pending[i]
                statuses[i] = status
                if status != 0:
                    return self._failed(i, where, status, actors[i])
                if i == 0:
                    finished_at = now
        return Outcome(0, "")

    def _failed(self, index: int, where: str, status: int, actor: Any) -> Outcome:
        import ray.exceptions  # binds `ray` too

        cause = f"the training process of {where} {_status_text(status)}"
        try:
            last = ray.get(cast("ray.ObjectRef[str]", actor.tail.remote(5)), timeout=10).strip()  # the log's text
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            last = ""
        if index != 0 and last:
            print(f"launch: the last lines of process {index}:\n{last}", file=sys.stderr, flush=True)
        if status == BAD_INPUT_STATUS:
            return Outcome(status, f"{cause}, lm-train's status for bad input: a restart cannot fix it", False)
        return Outcome(status, cause)

    def _stop(self, actors: list[Any]) -> None:
        """Stop every training process still running (SIGTERM, then SIGKILL), then the actors."""
        import ray

        stops = [a.stop.remote(self.stop_grace_s) for a in actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=self.stop_grace_s + 10)
        for actor in actors:
            ray.kill(actor)

    def _wait_until_dead(self, node_ids: set[str]) -> None:
        """Wait (at most the heartbeat timeout) until Ray too sees the lost nodes dead, so that the restart's
        placement group is not put on one of them."""
        import ray

        deadline = time.monotonic() + self.heartbeat_timeout_s
        while time.monotonic() < deadline:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if not alive & node_ids:
                return
            time.sleep(1.0)
