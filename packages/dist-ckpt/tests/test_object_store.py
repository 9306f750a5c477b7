"""Checkpoints in s3:// and gs:// buckets on real local servers (moto's S3 server, a GCS emulator): round trips
with a reshard, discovery, the keep policy's deletions, half-deleted checkpoints and a server that goes away in
the middle of a save. What is in the bucket is checked with plain clients (boto3, the GCS JSON API, tensorstore)."""

import os
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta

import jax
import numpy as np
import pytest
import tensorstore as ts
from dist_ckpt_buckets import Bucket
from dist_ckpt_testdata import reference_arrays
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt


@pytest.fixture(params=["s3", "gs"])
def bucket(request) -> Bucket:
    server = request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[request.param])
    return Bucket(server, server.new_bucket("ckpt"))


@pytest.fixture
def short_retries():
    """Give up on an unreachable server after about a second, so that outage tests stay short."""
    previous = dist_ckpt.set_retry_policy(dist_ckpt.RetryPolicy(max_attempts=3, initial_delay=0.1, max_delay=0.4))
    yield
    dist_ckpt.set_retry_policy(previous)


def mesh(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def sharded_state(step: int) -> dict:
    ref = reference_arrays(seed=step)
    m = mesh((2, 4), ("data", "model"))
    return {
        "params": {
            "embed": jax.device_put(ref["embed"], NamedSharding(m, P("data", "model"))),
            "mlp": jax.device_put(ref["mlp"], NamedSharding(m, P(None, "model"))),
        },
        "mask": jax.device_put(ref["mask"], NamedSharding(m, P("data"))),
        "host": np.arange(6, dtype=np.int64) * step,
        "step": step,
    }


def test_round_trip_with_reshard_discovery_and_plain_reads(bucket):
    root = bucket.url("runs/a/checkpoints")
    for step in (3, 7):
        dist_ckpt.save(sharded_state(step), f"{root}/step-{step}", step=step, metadata={"run": "a"}, block=True)
    assert dist_ckpt.latest(root) == f"{root}/step-7"
    assert [(i.path, i.step, i.committed) for i in dist_ckpt.list_checkpoints(root)] == [
        (f"{root}/step-3", 3, True),
        (f"{root}/step-7", 7, True),
    ]
    assert dist_ckpt.resolve_checkpoint(root) == f"{root}/step-7"
    assert dist_ckpt.resolve_checkpoint(f"{root}/step-3") == f"{root}/step-3"
    assert dist_ckpt.resolve_checkpoint(bucket.url("runs/b")) is None

    # A reshard from the bucket: another mesh, bitwise equal to the reference.
    other = mesh((4, 2), ("x", "y"))
    ref = reference_arrays(seed=7)
    target = {
        "params": {
            "embed": jax.ShapeDtypeStruct((16, 8), np.float32, sharding=NamedSharding(other, P("y", "x"))),
            "mlp": jax.ShapeDtypeStruct((8, 32), ref["mlp"].dtype, sharding=NamedSharding(other, P("x"))),
        },
        "mask": jax.ShapeDtypeStruct((8, 4), np.bool_, sharding=NamedSharding(other, P(None, "x"))),
        "host": np.zeros(6, np.int64),
        "step": 0,
    }
    loaded = dist_ckpt.load(f"{root}/step-7", target)
    assert np.asarray(loaded["params"]["embed"]).tobytes() == ref["embed"].tobytes()
    assert np.asarray(loaded["params"]["mlp"]).tobytes() == ref["mlp"].tobytes()
    assert loaded["params"]["embed"].sharding == target["params"]["embed"].sharding
    assert np.asarray(loaded["mask"]).tobytes() == ref["mask"].tobytes()
    assert loaded["host"].tolist() == [0, 7, 14, 21, 28, 35] and loaded["step"] == 7
    assert dist_ckpt.read_manifest(f"{root}/step-7")["metadata"] == {"run": "a"}

    # What the bucket holds, listed by the server: one object per chunk, and the markers.
    keys = bucket.keys("runs/a/checkpoints/step-7/")
    names = [key.removeprefix("runs/a/checkpoints/step-7/") for key in keys]
    assert {"COMMITTED", "manifest.json", "arrays/params.embed/zarr.json"} <= set(names)
    assert len([n for n in names if n.startswith("arrays/params.embed/c/")]) == 8  # 2 x 4 shards
    assert not any(n.startswith(".done") for n in names)  # one process: no done files
    if bucket.scheme == "s3":  # the commit marker is the last object written
        modified = bucket.modified("runs/a/checkpoints/step-7/")
        assert modified["runs/a/checkpoints/step-7/COMMITTED"] == max(modified.values())
    # Plain tensorstore, with a spec written by hand, reads the array.
    spec = {"driver": "zarr3", "kvstore": bucket.kvstore("runs/a/checkpoints/step-7/arrays/params.embed/")}
    assert ts.open(spec).result().read().result().tobytes() == ref["embed"].tobytes()


def test_keep_policy_deletes_superseded_temporaries_in_the_bucket(bucket):
    root = bucket.url("policy")
    ticks = iter(range(0, 10_000, 60))  # one minute per reading of the clock
    checkpointer = dist_ckpt.Checkpointer(
        root, save_interval=timedelta(minutes=2), keep=[{"every": 4}], clock=lambda: next(ticks), progress=False
    )
    assert checkpointer.root == root
    for step in range(1, 8):
        checkpointer.on_step({"w": np.full(4, step, np.float32), "step": step}, step)
    checkpointer.wait()
    infos = [(i.step, i.committed, i.temporary) for i in dist_ckpt.list_checkpoints(root)]
    assert infos == [(4, True, False), (6, True, True)]  # temporary 2 went once 4 was committed
    assert {key.split("/")[1] for key in bucket.keys("policy/")} == {"step-4", "step-6"}  # nothing of step-2 left
    assert checkpointer.latest() == f"{root}/step-6"
    assert dist_ckpt.load(checkpointer.latest(), {"w": np.zeros(4, np.float32), "step": 0})["step"] == 6


def test_half_deleted_checkpoints_are_never_loaded(bucket):
    root = bucket.url("half")
    for step in (1, 2, 3):
        dist_ckpt.save({"w": np.arange(8.0) + step}, f"{root}/step-{step}", step=step, block=True)
    # step-3 lost its marker first, as dist_ckpt deletes, and then some arrays: it is torn.
    bucket.delete("half/step-3/COMMITTED")
    bucket.delete("half/step-3/arrays/w/c/0")
    with pytest.warns(dist_ckpt.TornCheckpointWarning, match="step-3"):
        assert dist_ckpt.latest(root) == f"{root}/step-2"
    with pytest.raises(dist_ckpt.CheckpointError, match="no commit marker"):
        dist_ckpt.load(f"{root}/step-3")
    # step-2 lost a chunk but kept its marker (deleted in the wrong order by hand): a clear corruption error.
    bucket.delete("half/step-2/arrays/w/c/0")
    with pytest.raises(dist_ckpt.CorruptCheckpointError) as caught:
        dist_ckpt.load(f"{root}/step-2")
    assert caught.value.file == f"{root}/step-2/arrays/w/c/0" and caught.value.key == "['w']"
    assert "is missing" in str(caught.value) and "quarantine" in str(caught.value)
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match=r"c/0 \(leaf \['w'\]\) is missing"):
        dist_ckpt.verify(f"{root}/step-2")
    # Quarantine: the marker goes first, then the objects move to step-2.corrupt; latest() falls back to step-1.
    assert dist_ckpt.quarantine(f"{root}/step-2", reason=caught.value) == f"{root}/step-2.corrupt"
    assert bucket.keys("half/step-2/") == []
    moved = bucket.keys("half/step-2.corrupt/")
    assert "half/step-2.corrupt/CORRUPT" in moved and "half/step-2.corrupt/COMMITTED" not in moved
    with pytest.warns(dist_ckpt.TornCheckpointWarning):
        assert dist_ckpt.latest(root) == f"{root}/step-1"
    assert dist_ckpt.load(f"{root}/step-1")["['w']"].tolist() == (np.arange(8.0) + 1).tolist()
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match="marked corrupt"):
        dist_ckpt.load(f"{root}/step-2.corrupt")


def test_server_stopped_in_the_middle_of_a_save(bucket, short_retries):
    server, root = bucket.server, bucket.url("outage")
    checkpointer = dist_ckpt.Checkpointer(root, save_interval=None, progress=False)
    small = {"w": np.arange(16, dtype=np.float32)}
    checkpointer.on_step(small, 1, force=True)
    checkpointer.wait()
    before = bucket.keys("outage/step-1/")
    # The server goes down right after the first chunk of step-2 is written: the save is then mid-way, always.
    server.stop_after(
        lambda method, path: method in ("PUT", "POST") and "outage/step-2/arrays/" in path and "/c/" in path
    )
    big = {f"w{i}": np.full((64, 1024), i, np.float32) for i in range(16)}
    checkpointer.on_step(big, 2, force=True)
    try:  # the trainer's next call into the checkpointer raises, so that training stops rather than runs on
        with pytest.raises(dist_ckpt.BackgroundSaveError) as caught:
            checkpointer.wait()
    finally:
        server.start()
    message = str(caught.value)
    assert f"{root}/step-2" in message and "did not answer" in message and "AWS_ENDPOINT_URL" in message
    assert isinstance(caught.value.__cause__, dist_ckpt.StorageError)
    assert caught.value.__cause__.url.startswith(f"{root}/step-2")
    # The objects survived the restart; the torn step-2 is skipped and step-1 loads as saved.
    assert bucket.keys("outage/step-1/") == before
    torn = bucket.keys("outage/step-2/")
    assert any("/c/" in key for key in torn) and "outage/step-2/COMMITTED" not in torn  # stopped mid-way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
        assert dist_ckpt.latest(root) == f"{root}/step-1"
    assert dist_ckpt.load(f"{root}/step-1")["['w']"].tobytes() == small["w"].tobytes()


def test_an_outage_shorter_than_the_retries_is_ridden_out(s3_server):
    bucket = Bucket(s3_server, s3_server.new_bucket("ckpt"))
    previous = dist_ckpt.set_retry_policy(dist_ckpt.RetryPolicy(max_attempts=10, initial_delay=0.2, max_delay=1.0))
    try:
        s3_server.stop()
        restart = threading.Timer(1.0, s3_server.start)
        restart.start()
        start = time.monotonic()
        # Every request of this save (listing, arrays, manifest, marker) meets the outage or follows it.
        dist_ckpt.save({"w": np.arange(32.0)}, bucket.url("ride/step-1"), step=1, block=True)
        restart.join()
    finally:
        dist_ckpt.set_retry_policy(previous)
    assert time.monotonic() - start >= 0.9  # it did wait for the server
    assert "ride/step-1/COMMITTED" in bucket.keys("ride/")
    assert dist_ckpt.load(bucket.url("ride/step-1"))["['w']"].tolist() == list(np.arange(32.0))


SAVE_AND_LOAD = """
import numpy as np, dist_ckpt
dist_ckpt.save({"a": np.arange(4.0)}, URL, step=1, block=True, progress=False)
assert list(dist_ckpt.load(URL, progress=False).values())[0].tolist() == [0.0, 1.0, 2.0, 3.0]
"""


@pytest.mark.parametrize("ocdbt", [False, True])
def test_keys_in_the_environment_save_without_the_sdks_missing_file_lines(s3_server, tmp_path, ocdbt):
    """With the keys in AWS_* and no ~/.aws folder, the AWS SDK under tensorstore printed `E... Failed to open
    file '~/.aws/config'` (ten lines a process); the keys are the credentials, so nothing is missing."""
    url = s3_server.url(s3_server.new_bucket("quiet"), "run/step-1")
    code = SAVE_AND_LOAD.replace("URL", repr(url)).replace("step=1,", f"step=1, ocdbt={ocdbt},")
    home = tmp_path / "home"  # no .aws folder in it
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    env = env | s3_server.env | {"HOME": str(home), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "AuthCredentialsProvider" not in done.stderr and "Failed to open file" not in done.stderr, done.stderr


LIST_AND_LOAD = """
import json, numpy as np, dist_ckpt
root = "gs://odd/run/checkpoints"
for step in (1, 2):
    dist_ckpt.save({"w": np.arange(4.0) * step}, f"{root}/step-{step}", step=step, block=True, progress=False)
infos = [(str(i.path), i.step, i.committed) for i in dist_ckpt.list_checkpoints(root)]
print(json.dumps({"infos": infos, "latest": dist_ckpt.latest(root),
                  "w": dist_ckpt.load(dist_ckpt.latest(root), progress=False)["['w']"].tolist()}))
"""


def test_a_server_that_lists_outside_the_prefix_cannot_abort_the_interpreter(offset_blind_gcs_endpoint):
    """gcp-storage-emulator answers tensorstore's listing (by startOffset/endOffset) with the whole bucket; a name
    shorter than the prefix made tensorstore's gcs kvstore abort the process (exit 134) in the first listing."""
    import json
    import urllib.request

    def call(method: str, path: str, data: bytes, content_type: str) -> None:
        url = f"{offset_blind_gcs_endpoint}{path}"
        request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    call("POST", "/storage/v1/b?project=test", b'{"name": "odd"}', "application/json")
    call("POST", "/upload/storage/v1/b/odd/o?uploadType=media&name=a", b"x", "application/octet-stream")
    env = os.environ | {"STORAGE_EMULATOR_HOST": offset_blind_gcs_endpoint, "JAX_PLATFORMS": "cpu"}
    env.pop("TENSORSTORE_GCS_HTTP_URL", None)
    done = subprocess.run([sys.executable, "-c", LIST_AND_LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    root = "gs://odd/run/checkpoints"
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "infos": [[f"{root}/step-1", 1, True], [f"{root}/step-2", 2, True]],
        "latest": f"{root}/step-2",
        "w": [0.0, 2.0, 4.0, 6.0],
    }
    assert "Replacing torn checkpoint" not in done.stderr  # step-2's own prefix was empty before its save
