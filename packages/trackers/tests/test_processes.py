"""Only process 0 writes: two real jax processes build the same configs into the same run directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

import trackers

_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    process_id, port, run_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import trackers
    configs = trackers.tracker_configs_from_value(
        [{"type": "jsonl"}, {"type": "jsonl", "path": "all.jsonl", "all_processes": True}]
    )
    with trackers.build_tracker(configs, run_dir) as tracker:
        tracker.log({"process": jax.process_index()}, step=1)
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_process_index_comes_from_jax_when_it_is_imported():
    import jax

    assert trackers.current_process_index() == jax.process_index() == 0


@pytest.mark.multiprocess
def test_only_process_zero_writes_unless_all_processes(tmp_path):
    port = str(_free_port())
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(index), port, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in range(2)
    ]
    outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], outputs

    def entries(name):
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]

    assert entries("metrics.jsonl") == [{"step": 1, "process": 0}]
    assert not list(tmp_path.glob("metrics.process-*"))
    assert entries("all.jsonl") == [{"step": 1, "process": 0}]
    assert entries("all.process-1.jsonl") == [{"step": 1, "process": 1}]
