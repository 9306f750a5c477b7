"""Starting Ray from a process where JAX already runs threads (as lm-train does)."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

SCRIPT = """
import warnings
import jax
jax.numpy.ones(1).block_until_ready()  # JAX's threads are running from here on
from shard_cache import ensure_ray
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ray = ensure_ray(num_cpus=1, temp_dir=sys.argv[1])
    ray.shutdown()
    import os
    pid = os.fork()  # a fork outside Ray's start still gets JAX's warning
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
print(sum(str(w.message).startswith("os.fork() was called") for w in caught))
"""


def test_ray_start_does_not_print_jax_fork_warning():
    pytest.importorskip("jax")
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import sys\n" + SCRIPT, ray_dir], capture_output=True, text=True, timeout=180
        )
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # Only the test's own bare fork warns: Ray's start of its daemons does not.
    assert done.stdout.strip().splitlines()[-1] == "1", done.stdout + done.stderr[-2000:]


LONG_TMPDIR_SCRIPT = """
import sys
from shard_cache import ensure_ray
ray = ensure_ray(num_cpus=1)
print(ray.get(ray.remote(lambda: 6 * 7).remote()))
ray.shutdown()
"""


def test_ray_starts_under_a_tmpdir_too_long_for_its_sockets(tmp_path):
    """A job's private TMPDIR may be long; Ray's default temp dir under it would make socket paths over 107 bytes."""
    long_tmp = tmp_path / ("scratch-of-a-job-with-a-long-name-" * 3)
    long_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["TMPDIR"] = str(long_tmp)
    done = subprocess.run(
        [sys.executable, "-c", LONG_TMPDIR_SCRIPT], capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "42"


THREADS_SCRIPT = """
import logging, sys, threading, time
from shard_cache import ensure_ray
logging.basicConfig(stream=sys.stderr)  # where Ray's notes would show
asked = [threading.Thread(target=ensure_ray, kwargs={"num_cpus": 1, "temp_dir": sys.argv[1]}) for _ in range(2)]
for thread in asked:
    thread.start()
for thread in asked:
    thread.join()  # the threads that asked for Ray are gone...
time.sleep(2)
import ray
print(ray.get(ray.remote(lambda: 6 * 7).remote(), timeout=60))  # ...and Ray still runs
ray.shutdown()
"""


def test_ray_started_from_threads_that_then_end_is_one_ray_that_keeps_running():
    """Build threads start Ray, so that it starts while the caller goes on; Ray's daemons die with the thread that
    started them, so that thread must not be the build's."""
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        done = subprocess.run(
            [sys.executable, "-c", THREADS_SCRIPT, ray_dir], capture_output=True, text=True, timeout=180
        )
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "42"
    assert done.stderr.count("Started a local Ray instance") == 1, done.stderr[-3000:]
    assert "SIGTERM handler is not set" not in done.stderr
