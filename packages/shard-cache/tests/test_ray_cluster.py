"""One Ray cluster over the processes of a multi-process run: found like jax.distributed's coordinator, used
by the cache build on every node."""

import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from shard_cache import ShardCacheError, find_coordinator_host, start_ray_cluster
from shard_cache.ray_runtime import first_slurm_host

# Each of the 4 processes runs this: join (process 0: start) the cluster; process 0 builds a cache whose
# processor records the Ray node of every chunk it tokenizes, then writes result.json; every process then stops
# its node, except process 3, which the test kills with SIGKILL instead.
PROCESS = """
import json, os, sys, time, uuid
from pathlib import Path
from shard_cache import TokenizerProcessor, build_cache, start_ray_cluster

index, port, work, tokenizer = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

class NodeRecordingProcessor(TokenizerProcessor):
    def __call__(self, docs):
        import ray
        (work / "nodes" / f"{ray.get_runtime_context().get_node_id()}-{uuid.uuid4().hex}").touch()
        time.sleep(0.5)  # long enough that the shards run side by side, one per node
        return super().__call__(docs)

started = time.monotonic()
# On one host, nodes that start together starve each other's agents (Ray gives them 15 s): join one at a time.
while index > 1 and not (work / f"joined-{index - 1}").exists():
    time.sleep(0.1)
cluster = start_ray_cluster(index, 4, "127.0.0.1", port=port, num_cpus=1, object_store_memory=80 * 2**20,
                            timeout_s=150)
assert os.environ["RAY_ADDRESS"] == cluster.address == f"127.0.0.1:{port}"
print("joined", index, cluster.log_path, flush=True)
(work / f"joined-{index}").touch()
if index == 0:
    import ray
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    head = [n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]]
    joined = time.monotonic() - started
    (work / "nodes").mkdir()
    seen = []
    result = build_cache(sorted(str(p) for p in (work / "corpus").iterdir()), str(work / "cache"),
                         processor=NodeRecordingProcessor(tokenizer), chunk_size=4, progress=False,
                         metrics_callback=seen.append, in_process=False)
    ran_on = sorted({p.name.split("-")[0] for p in (work / "nodes").iterdir()})
    info = {"nodes": nodes, "ran_on": ran_on, "docs": result.docs, "joined_s": joined, "head": head,
            "driver_node": ray.get_runtime_context().get_node_id(), "counted_nodes": seen[-1].nodes}
    (work / "result.json").write_text(json.dumps(info))
else:
    while not (work / "result.json").exists():
        time.sleep(0.1)
if index == 3:
    time.sleep(600)  # killed here
cluster.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_processes_of(log_dir: str) -> list[str]:
    """Processes still running that belong to the node whose temp dir holds `log_dir`."""
    root = os.path.dirname(log_dir)
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if root in line]


def test_four_processes_form_one_cluster_whose_build_runs_on_every_node(tmp_path, tokenizer_path, tools):
    (tmp_path / "corpus").mkdir()
    for s in range(8):
        tools.write_jsonl(tmp_path / "corpus" / f"part-{s}.jsonl", tools.make_docs(8, seed=40 + s))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(i), str(port), str(tmp_path), str(tokenizer_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(4)
    ]
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "result.json").exists() and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in processes):
                break
            time.sleep(0.2)
        processes[3].kill()  # SIGKILL: no shutdown, no atexit
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [0, 0, 0, -9], "\n\n".join(o[-3000:] for o in outputs)
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["nodes"]) == 4  # one node per process
    assert result["ran_on"] == result["nodes"], "every process's node ran build tasks"
    assert result["counted_nodes"] == 4  # the build's own count, as lm-train logs it (preprocessing/nodes)
    assert result["docs"] == 64
    # process 0's driver is attached to the head node it started, though all four nodes share this host
    assert result["head"] == [result["driver_node"]]
    # every process stopped its node, on shutdown or (process 3) on its death: no daemon of theirs is left
    logs = [line.split()[-1] for out in outputs for line in out.splitlines() if line.startswith("joined")]
    assert len(logs) == 4
    deadline = time.monotonic() + 30
    while [p for log in logs for p in ray_processes_of(log)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for log in logs for p in ray_processes_of(log)]
    shutil.rmtree(os.path.dirname(logs[3]), ignore_errors=True)  # the killed process could not remove it


def test_a_single_process_or_an_existing_cluster_starts_nothing(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    alone = start_ray_cluster(0, 1)
    assert alone.address is None and not alone.started_node
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    existing = start_ray_cluster(2, 4)
    assert existing.address == "10.0.0.9:6379" and not existing.started_node
    existing.shutdown()
    with pytest.raises(ShardCacheError, match=r"process_index must be in \[0, 4\)"):
        start_ray_cluster(4, 4)


def test_without_a_host_for_the_head_the_error_says_what_to_pass(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TPU_", "MEGASCALE_", "RAY_ADDRESS")):
            monkeypatch.delenv(key)
    with pytest.raises(ShardCacheError, match=r"Pass coordinator_host .* or set RAY_ADDRESS"):
        start_ray_cluster(1, 2)


def test_a_worker_whose_head_never_answers_fails_within_its_timeout(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = time.monotonic()
    with pytest.raises(ShardCacheError, match=r"the Ray head at 127\.0\.0\.1:\d+ did not answer within 1 s"):
        start_ray_cluster(1, 2, "127.0.0.1", port=free_port(), timeout_s=1)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node001", "node001"),
        ("node001,host2", "node001"),
        ("node[001-0015],host2", "node001"),
        ("node[007,001-003]", "node007"),
        ("rack[2-3]-gpu[10-12]", "rack2-gpu10"),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_coordinator_host_is_found_as_jax_finds_its_coordinator():
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[3-4]", "SLURM_JOB_NODELIST": "gpu[1-4]"}
    assert find_coordinator_host(slurm) == "gpu3"
    assert find_coordinator_host({"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[1-4]"}) == "gpu1"
    assert find_coordinator_host({"SLURM_STEP_NODELIST": "gpu1"}) is None  # not inside a job
    assert find_coordinator_host({"TPU_WORKER_HOSTNAMES": "t1k-w-0,t1k-w-1"}) == "t1k-w-0"
    assert find_coordinator_host({"MEGASCALE_COORDINATOR_ADDRESS": "10.1.2.3:8080", **slurm}) == "10.1.2.3"
    assert find_coordinator_host({}) is None


def test_coordinator_host_of_a_tpu_vm_comes_from_its_metadata_server():
    seen = []

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Metadata-Flavor")))
            body = b"unknown:unknown:10.130.0.2,unknown:unknown:10.130.0.3"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"TPU_ACCELERATOR_TYPE": "v4-16", "GCE_METADATA_IP": f"127.0.0.1:{server.server_port}"}
        assert find_coordinator_host(env) == "10.130.0.2"
        assert seen == [("/computeMetadata/v1/instance/attributes/worker-network-endpoints", "Google")]
        assert find_coordinator_host({**env, "TPU_SKIP_MDS_QUERY": "1"}) is None
    finally:
        server.shutdown()
