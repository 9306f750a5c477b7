"""Fixtures for dist-ckpt tests: a launcher of real jax.distributed worker processes, and test data."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
# The workers and these tests share the reference data module (dist_ckpt_testdata.py) in WORKERS.
if str(WORKERS) not in sys.path:
    sys.path.insert(0, str(WORKERS))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _report(procs: list[subprocess.Popen], outputs: list[tuple[str, str]], why: str) -> str:
    lines = [why]
    for index, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        lines.append(f"--- process {index} (exit code {proc.returncode}) stdout:\n{out}")
        lines.append(f"--- process {index} stderr:\n{err}")
    return "\n".join(lines)


def launch(script: str, *args: str, processes: int, devices: int, timeout: float = 120.0) -> list[str]:
    """Run `processes` copies of workers/`script` as one jax.distributed job; return their stdouts.

    Fails the test, showing every process's stdout and stderr, if any exits non-zero or time runs out.
    """
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / script), str(index), str(processes), port, *args],
            env=worker_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(processes)
    ]
    outputs: list[tuple[str, str]] = [("", "")] * processes
    why = ""
    try:
        for index, proc in enumerate(procs):
            outputs[index] = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        why = f"{script}: timed out after {timeout} s"
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate() for proc in procs]
    if not why and any(proc.returncode != 0 for proc in procs):
        why = f"{script}: a process failed"
    if why:
        pytest.fail(_report(procs, outputs, why))
    return [out for out, _ in outputs]


@pytest.fixture
def run_workers():
    """The launcher: run_workers(script, *args, processes=2, devices=4) -> list of stdouts."""
    return launch


@pytest.fixture
def start_worker():
    """Start one worker (process id 0 of 1) without waiting, for tests that kill it; cleaned up after."""
    started: list[subprocess.Popen] = []

    def start(script: str, *args: str, devices: int = 2) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, str(WORKERS / script), "0", "1", str(free_port()), *args],
            env=worker_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.communicate()


def read_json_lines(text: str) -> list[dict]:
    """The JSON objects a worker printed, one per line (other lines ignored)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
