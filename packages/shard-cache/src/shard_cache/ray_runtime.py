"""Start a quiet local Ray on demand, join an existing cluster, or make one cluster of a run's hosts."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shard_cache.errors import ShardCacheError

QUIET_ENV = {
    # Under `uv run`, Ray would otherwise copy the whole workspace (.venv included) into every session.
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    # No implicit ray.init() from a Ray call made while Ray is down (a build thread outliving a shutdown): it
    # would join whatever cluster /tmp/ray records, on a shared host someone else's.
    "RAY_ENABLE_AUTO_CONNECT": "0",
}
OBJECT_STORE_BYTES = 256 * 2**20
# Ray's longest socket path is its temp dir + "/session_<date>_<time>_<micros>_<pid>/sockets/plasma_store",
# about 66 bytes more; AF_UNIX allows 107.
LONGEST_RAY_TEMP_DIR = 40


_STARTING = threading.Lock()  # two build threads asking at once start one Ray, not two


class _ThreadStartNote(logging.Filter):
    """Drops Ray's note that a start off the main thread sets no SIGTERM handler: builds start Ray in their
    thread on purpose, and the caller's own handlers (lm-train's stop request) are the ones that should act."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SIGTERM handler is not set")


def ensure_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None) -> Any:
    """Return the `ray` module, initialised: the running instance, the cluster at `address`/RAY_ADDRESS, or a
    new quiet local one (no dashboard, bounded object store). Safe to call from several threads at once."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    with _STARTING:
        if ray.is_initialized():
            pass
        elif threading.current_thread() is threading.main_thread():
            _init(ray, address, num_cpus, temp_dir)
        else:
            _init_on_a_thread_that_stays(ray, address, num_cpus, temp_dir)
    return ray


def _init_on_a_thread_that_stays(ray: Any, address: str | None, num_cpus: int | None, temp_dir: str | None) -> None:
    """Start Ray on a thread that lives as long as the process: Ray's daemons get a parent-death signal, which
    Linux sends when the *thread* that started them ends, so a build thread that started them and then returned
    would take the whole local Ray down with it."""
    started, failure = threading.Event(), []

    def start_and_stay() -> None:
        try:
            _init(ray, address, num_cpus, temp_dir)
        except BaseException as exc:  # handed to the caller, raised there
            failure.append(exc)
            started.set()
            return
        started.set()
        threading.Event().wait()  # until the process exits (a daemon thread)

    threading.Thread(target=start_and_stay, name="shard-cache-ray", daemon=True).start()
    started.wait()
    if failure:
        raise failure[0]


def _init(ray: Any, address: str | None, num_cpus: int | None, temp_dir: str | None) -> None:
    if threading.current_thread() is not threading.main_thread():
        worker_log = logging.getLogger("ray._private.worker")
        if not any(isinstance(f, _ThreadStartNote) for f in worker_log.filters):
            worker_log.addFilter(_ThreadStartNote())
    address = address or os.environ.get("RAY_ADDRESS")
    with warnings.catch_warnings():
        # JAX warns on every fork once it has started its threads. Ray's forks here start its daemons:
        # between fork and exec the child only sets a signal mask and a parent-death signal, and touches no
        # lock another thread could hold, so the deadlock JAX warns about cannot happen there; the warning
        # would only alarm every cold `lm-train run`.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # "local": a new instance of our own even when another cluster was started on this machine with
            # `ray start` (ray.init() would otherwise join that one, with its settings and its other users).
            _start_local(ray, num_cpus, temp_dir)


def _start_local(ray: Any, num_cpus: int | None, temp_dir: str | None, attempts: int = 3) -> None:
    """A new local instance, retried: Ray gives its node a fixed 30 s to register with its GCS, which a busy
    machine (two cores compiling XLA beside it) can overrun ("The current node timed out during startup")."""
    if temp_dir is None and len(os.path.join(tempfile.gettempdir(), "ray")) > LONGEST_RAY_TEMP_DIR:
        # Ray keeps its sockets under its temp dir, by default $TMPDIR/ray, and an AF_UNIX path stops at 107
        # bytes: a long TMPDIR (a job's private scratch directory) failed the start with an OSError. /tmp/ray is
        # Ray's own choice where TMPDIR is unset.
        temp_dir = "/tmp/ray"
    for attempt in range(attempts):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=OBJECT_STORE_BYTES,
                _temp_dir=temp_dir,
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for this one
            if "timed out during startup" not in str(exc) or attempt == attempts - 1:
                raise
            ray.shutdown()
            warnings.warn(f"Ray's local node did not start in time ({exc}); starting it again.", stacklevel=3)


# ---- one Ray cluster over the hosts of a multi-process run ----

DEFAULT_RAY_PORT = 6379  # Ray's own default for the head's GCS
JOIN_TIMEOUT_S = 300.0  # as long as jax.distributed waits for its processes
_NODE_ENV = {
    # A node stops at once when told to: there is nothing to drain between cache builds.
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
}
# Runs `ray start ... --block` with a parent-death signal: if the process that started the node dies, even by
# SIGKILL, the node gets SIGTERM and stops its daemons, so no orphan node keeps the port or the CPUs.
_NODE_LAUNCHER = """
import ctypes, os, runpy, signal, sys
parent = int(sys.argv.pop(1))
ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    sys.exit(1)
sys.argv[0] = "ray"
runpy.run_module("ray.scripts.scripts", run_name="__main__")
"""


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as `gpu[003-010,012],cpu7` (here `gpu003`)."""
    host, depth = [], 0
    taking = True  # inside brackets, only the first range's first value is kept
    for ch in nodelist.strip():
        if ch == "[":
            depth, taking = depth + 1, True
        elif ch == "]":
            depth -= 1
        elif depth:
            if ch in ",-":
                taking = False
            elif taking:
                host.append(ch)
        elif ch == ",":
            break
        else:
            host.append(ch)
    return "".join(host)


def _tpu_metadata(key: str, environ: Mapping[str, str], timeout_s: float) -> str | None:
    """A TPU VM's instance attribute from the GCE metadata server (GCE_METADATA_IP overrides its address)."""
    import urllib.error
    import urllib.request

    host = environ.get("GCE_METADATA_IP", "metadata.google.internal")
    request = urllib.request.Request(
        f"http://{host}/computeMetadata/v1/instance/attributes/{key}", headers={"Metadata-Flavor": "Google"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode("utf-8").strip() or None
    except (OSError, urllib.error.URLError):
        return None


def find_coordinator_host(environ: Mapping[str, str] | None = None, metadata_timeout_s: float = 5.0) -> str | None:
    """The host of process 0, found where jax.distributed finds its coordinator; None outside a cluster.

    In order: a multislice TPU's MEGASCALE_COORDINATOR_ADDRESS; TPU_PROCESS_ADDRESSES or TPU_WORKER_HOSTNAMES
    (GKE); SLURM's first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST); and on a Cloud TPU VM
    (TPU_ACCELERATOR_TYPE set, TPU_SKIP_MDS_QUERY not) the first of the metadata server's
    worker-network-endpoints.
    """
    env = os.environ if environ is None else environ
    for key in ("MEGASCALE_COORDINATOR_ADDRESS", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        if env.get(key):
            return env[key].split(",")[0].strip().split(":")[0]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "SLURM_JOB_ID" in env and nodelist:
        return first_slurm_host(nodelist)
    if env.get("TPU_ACCELERATOR_TYPE") and "TPU_SKIP_MDS_QUERY" not in env:
        endpoints = _tpu_metadata("worker-network-endpoints", env, metadata_timeout_s)
        if endpoints:  # "name:id:ip,..." (older VMs) or "host,..."
            return endpoints.split(",")[0].strip().split(":")[-1]
    return None


@dataclass
class RayCluster:
    """This process's part of the run's Ray cluster; `shutdown()` stops the node this process started."""

    address: str | None  # the head's GCS address; None: a single process (Ray starts locally on demand)
    process_index: int
    process_count: int
    started_node: bool = False  # whether this process runs a node of its own (head or worker)
    log_path: str | None = None  # the node's `ray start` output
    _process: subprocess.Popen | None = field(default=None, repr=False)
    _temp_dir: str | None = field(default=None, repr=False)
    _previous_address: str | None = field(default=None, repr=False)

    def shutdown(self, timeout_s: float = 30.0, keep_logs: bool = False) -> None:
        """Disconnect from Ray and stop this process's node (idempotent); its temp dir goes unless `keep_logs`."""
        if self._process is None:
            return
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        process, self._process = self._process, None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # `ray start --block` then stops every daemon of its node
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()  # its daemons share its fate
                process.wait(timeout_s)
        if os.environ.get("RAY_ADDRESS") == self.address:
            if self._previous_address is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = self._previous_address
        if self._temp_dir is not None and not keep_logs:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no output)"


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except OSError:
        return False


def _start_node(args: list[str], temp_dir: str) -> tuple[subprocess.Popen, str]:
    log_path = os.path.join(temp_dir, "ray-start.log")
    env = {**os.environ, **QUIET_ENV, **_NODE_ENV}
    env.pop("RAY_ADDRESS", None)  # `ray start` would take it for the cluster to join
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _NODE_LAUNCHER, str(os.getpid()), "start", "--block", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return process, log_path


def _wait(condition: Callable[[], bool], process: subprocess.Popen, deadline: float, what: str, log: str) -> None:
    while not condition():
        if process.poll() is not None:
            raise ShardCacheError(f"{what}: `ray start` exited with status {process.returncode}:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise ShardCacheError(f"{what}: timed out. The last lines of `ray start` ({log}):\n{_log_tail(log)}")
        time.sleep(0.2)


def start_ray_cluster(
    process_index: int,
    process_count: int,
    coordinator_host: str | None = None,
    *,
    port: int = DEFAULT_RAY_PORT,
    num_cpus: int | None = None,
    object_store_memory: int = OBJECT_STORE_BYTES,
    node_ip_address: str | None = None,
    timeout_s: float = JOIN_TIMEOUT_S,
) -> RayCluster:
    """Make one Ray cluster of every process of a multi-process run, so that cache builds use every host's CPUs.

    Call it in every process with the process's index and the process count (jax.process_index() and
    jax.process_count(), say). Process 0 starts a Ray head on `coordinator_host`:`port` and waits until all
    `process_count` nodes have joined; every other process starts a Ray worker node that joins it. The host of
    process 0 is `coordinator_host`, else found the way jax.distributed finds its coordinator (SLURM, TPU env or
    metadata: see `find_coordinator_host`). A cluster given by RAY_ADDRESS is used as is (nothing is started),
    and a single process starts nothing (Ray starts locally when a build needs it). Afterwards RAY_ADDRESS names
    the cluster, so that `build_cache` and `ensure_ray` join it. Each node has `num_cpus` CPUs (default: all
    that its host lets this process use) and a bounded object store. A node stops with `shutdown()`, at
    interpreter exit, or when the thread that started it ends or the process dies (even by SIGKILL): call this
    from the main thread. Every failure (no head host, head unreachable, port taken, a node missing) raises
    ShardCacheError with `ray start`'s last lines.
    """
    if not 0 <= process_index < process_count:
        raise ShardCacheError(f"process_index must be in [0, {process_count}), got {process_index}.")
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    existing = os.environ.get("RAY_ADDRESS")
    if existing:
        return RayCluster(existing, process_index, process_count)
    if process_count == 1:
        return RayCluster(None, process_index, process_count)
    host = coordinator_host or find_coordinator_host()
    if not host:
        raise ShardCacheError(
            f"process {process_index} of {process_count}: no host for the Ray head. Pass coordinator_host (the "
            "host of process 0, as for jax.distributed), run under SLURM or on a TPU VM where it is found, or set "
            "RAY_ADDRESS to a running Ray cluster."
        )
    address = f"{host}:{port}"
    deadline = time.monotonic() + timeout_s
    if process_index > 0 and not _wait_for_head(host, port, deadline):
        raise ShardCacheError(
            f"process {process_index}: the Ray head at {address} did not answer within {timeout_s:.0f} s. Is "
            "process 0 running, and is the port open between the hosts? (Pass the same coordinator_host and "
            "port to every process.)"
        )
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    args = [f"--object-store-memory={object_store_memory}", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    args += ["--include-log-monitor=false"]  # it streams worker logs to drivers, which do not show them
    args += [f"--num-cpus={num_cpus}"] if num_cpus is not None else []  # else Ray counts the host's usable CPUs
    args += [f"--node-ip-address={node_ip_address}"] if node_ip_address else []
    if process_index == 0:
        args = ["--head", f"--port={port}", "--include-dashboard=false", *args]
    else:
        args = [f"--address={address}", *args]
    process, log_path = _start_node(args, temp_dir)
    cluster = RayCluster(address, process_index, process_count, True, log_path, process, temp_dir, existing)
    atexit.register(cluster.shutdown)
    try:
        if process_index == 0:
            _wait(lambda: _reachable(host, port), process, deadline, f"starting the Ray head at {address}", log_path)
            _connect_and_wait_for_nodes(address, temp_dir, process_count, process, deadline, log_path)
        else:
            joined = lambda: "Ray runtime started" in _log_tail(log_path, 40)  # noqa: E731
            what = f"process {process_index}: joining the Ray head at {address}"
            _wait(joined, process, deadline, what, log_path)
    except BaseException:
        cluster.shutdown(keep_logs=True)  # the error names the log
        raise
    os.environ["RAY_ADDRESS"] = address
    return cluster


def _wait_for_head(host: str, port: int, deadline: float) -> bool:
    while not _reachable(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _connect_and_wait_for_nodes(
    address: str, temp_dir: str, count: int, process: subprocess.Popen, deadline: float, log_path: str
) -> None:
    """Connect this process (process 0) to its head as the driver, then wait until `count` nodes are alive."""
    import ray

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
            ray.init(address=address, _temp_dir=temp_dir, log_to_driver=False)  # the head, not a worker here
    except (ConnectionError, RuntimeError) as exc:
        raise ShardCacheError(
            f"connecting to the Ray head at {address} that this process started: {exc}. The last lines of "
            f"`ray start` ({log_path}):\n{_log_tail(log_path)}"
        ) from None
    alive = lambda: sum(1 for n in ray.nodes() if n["Alive"])  # noqa: E731
    try:
        _wait(lambda: alive() >= count, process, deadline, f"waiting for {count} Ray nodes at {address}", log_path)
    except ShardCacheError as exc:
        joined = f"Only {alive()} of {count} nodes joined; the other processes' nodes did not."
        raise ShardCacheError(f"{exc}\n{joined}") from None
