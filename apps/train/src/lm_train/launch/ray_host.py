"""The Ray actor that runs one training process on its node, and answers the launcher's polls (its heartbeat)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

READ_LIMIT = 1 << 18
"""At most this many bytes of console per poll: a flood of output reaches the caller over several polls."""
BATCH_S = 0.25
"""A poll that waits for console output looks this often, and answers no sooner: a chatty process's lines arrive
in batches, a few answers a second."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def remote_cause(error: Exception) -> str:
    """What raised inside an actor, in one line (a RayTaskError's own text is the remote traceback)."""
    cause = getattr(error, "cause", None)
    if cause is None:
        return str(error).strip().splitlines()[-1]
    return f"{type(cause).__name__}: {cause}"


def _shipped_folder() -> str:
    """The actor's working directory, where Ray unpacked the shipped folder, by name.

    Ray nodes that share one machine (or one /tmp) share its runtime_resources folder, and each node's agent
    unpacks a job's package afresh the first time it sets the job up, removing the folder first. An actor started
    on another node just before is then left in a removed directory, while the same path holds the new copy: Ray
    started the actor with `cd <folder> &&`, so PWD still names it. Once every actor of a launch has answered,
    every node's copy is in place."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        folder = os.environ.get("PWD", "")
        if not os.path.isdir(folder):
            raise
        os.chdir(folder)
        return folder


def _host_env(extra: dict[str, str]) -> dict[str, str]:
    """The node's own environment without the Ray worker's variables (the process may join the cluster as a
    driver of its own, for cache builds), plus the launch's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    shipped = extra.get("PYTHONPATH", "")
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (shipped, os.environ.get("PYTHONPATH", "")) if p)
    return env


class HostProcess:
    """One host's training process: started from the shipped folder, watched, stopped."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._exited = threading.Event()
        self._log = os.path.join(tempfile.mkdtemp(prefix="lm-train-host-"), "console.log")

    def describe(self, with_port: bool) -> dict[str, Any]:
        """This host: its Ray node id, IP, the shipped folder (the actor's working directory) and a free port."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "workdir": _shipped_folder(),
            "port": _free_port() if with_port else None,
        }

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        """Start the process; its pid. It is started by a thread that lives as long as it does: with setpriv's
        --pdeathsig it then dies with this actor, as a lost host's processes do, instead of running on alone."""
        prefix = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with open(self._log, "ab") as log:
                    self._process = subprocess.Popen(
                        [*prefix, *argv],
                        cwd=cwd,
                        env=_host_env(env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
            except BaseException as e:  # reported by start(), in the caller
                failure.append(e)
            finally:
                started.set()
            if self._process is not None:
                self._process.wait()
            self._exited.set()

        threading.Thread(target=run, name="lm-train-host-process", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]
        assert self._process is not None  # run() started it, or its failure was raised above
        return self._process.pid

    def poll(self, offset: int | None, wait_s: float = 0.0) -> tuple[bytes, int, int | None]:
        """(console bytes from `offset` on, the next offset, the exit status or None while it runs); a None
        offset reads nothing (hosts other than process 0's only answer). Waits up to `wait_s` for news: the exit,
        or console output past `offset`."""
        started = time.monotonic()
        while not self._exited.is_set():
            waited = time.monotonic() - started
            if waited >= wait_s or (offset is not None and waited >= BATCH_S and self._written() > offset):
                break
            # Woken at once by the exit; console output is looked for every BATCH_S.
            self._exited.wait(min(BATCH_S if offset is not None else wait_s, wait_s - waited))
        status = self._process.poll() if self._process is not None else None
        if offset is None:
            return b"", 0, status
        with open(self._log, "rb") as f:
            f.seek(offset)
            data = f.read(READ_LIMIT)
        if status is not None and len(data) == READ_LIMIT:
            status = None  # more to read first: the exit is reported with the last bytes
        return data, offset + len(data), status

    def _written(self) -> int:
        try:
            return os.path.getsize(self._log)
        except FileNotFoundError:
            return 0

    def tail(self, lines: int) -> str:
        """The last lines of the console, for the cause of a failure."""
        with open(self._log, "rb") as f:
            f.seek(max(0, os.path.getsize(self._log) - 16384))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM (lm-train then saves at its next step if it can), SIGKILL after `grace_s`; the exit status."""
        process = self._process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        print(f"stopped the training process {process.pid}: exit status {process.returncode}", file=sys.stderr)
        return process.returncode
