"""Two real jax.distributed processes save (to a directory and to a bucket); one process with another mesh loads
the same bits; the keep policy's decisions and deletions are process 0's alone."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from dist_ckpt_buckets import Bucket
from dist_ckpt_testdata import reference_arrays
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("storage", ["zarr3", "ocdbt"])
def test_two_process_save_then_one_process_load_on_another_mesh(run_workers, tmp_path, storage, request):
    extra, roots = (["ocdbt"], [tmp_path]) if storage == "ocdbt" else ([], [tmp_path])
    if storage == "zarr3":  # the same launch also saves to a bucket, each process writing its own shards there
        server = request.getfixturevalue("s3_server")
        bucket = Bucket(server, server.new_bucket("mp"))
        extra, roots = [bucket.url("run")], [tmp_path, bucket.url("run")]
    outs = run_workers("mp_save.py", str(tmp_path), *extra, processes=2, devices=4)
    assert [out.strip().splitlines()[-1] for out in outs] == ["process 0 saved", "process 1 saved"]
    for root in roots:
        check_two_process_checkpoint(f"{root}/step-7", storage)
    if storage == "zarr3":
        keys = bucket.keys("run/step-7/")
        assert "run/step-7/.done/process-1.json" in keys and "run/step-7/COMMITTED" in keys
        # Process 1's shards carry checksums that process 0 gathered into the manifest: a full check passes.
        dist_ckpt.verify(bucket.url("run/step-7"), read_data=True)


def check_two_process_checkpoint(checkpoint: str, storage: str) -> None:
    """Load the checkpoint that mp_save.py wrote onto another mesh of this process and compare bit for bit."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))  # 8 local devices, another layout

    def target(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    ref = reference_arrays()
    tgt = {
        "params": {
            "embed": target((16, 8), ref["embed"].dtype, P("y", "x")),
            "mlp": target((8, 32), ref["mlp"].dtype, P("x", None)),
            "bias": target((32,), ref["bias"].dtype, P(("x", "y"))),
        },
        "opt_state": ({"mu": target((16, 8), np.int32, P(None, "y"))}, None),
        "key": target((2,), np.uint32, P()),
        "mask": target((8, 4), np.bool_, P("x", "y")),
        "host_counts": np.zeros(6, np.int64),
        "step": 0,
    }
    loaded = dist_ckpt.load(checkpoint, tgt)

    def by_name(tree):
        return {**tree["params"], "mu": tree["opt_state"][0]["mu"], "key": tree["key"], "mask": tree["mask"]}

    got, wanted = by_name(loaded), by_name(tgt)
    for name, expected in ref.items():
        array = got[name]
        assert array.sharding == wanted[name].sharding
        assert np.asarray(array).dtype == expected.dtype
        assert np.asarray(array).tobytes() == expected.tobytes(), name  # bitwise
    assert loaded["opt_state"][1] is None
    np.testing.assert_array_equal(loaded["host_counts"], np.arange(6))
    assert loaded["step"] == 7
    manifest = dist_ckpt.read_manifest(checkpoint)
    assert manifest["process_count"] == 2 and manifest["metadata"] == {"run": "mp"}
    if "://" not in checkpoint:
        assert (Path(checkpoint) / ("arrays.ocdbt" if storage == "ocdbt" else "arrays")).is_dir()


def expected_saves(steps: int, interval: float, every: int, clock_rate: float) -> dict[int, bool]:
    """Step -> temporary?, of the saves a timer on process 0's clock plus a keep rule must take."""
    saves, last_time = {}, 0.0
    for step in range(1, steps + 1):
        now = clock_rate * step
        if step % every == 0:
            saves[step], last_time = False, now
        elif now - last_time >= interval:
            saves[step], last_time = True, now
    return saves


def worker_lines(out: str, start: str) -> list[dict]:
    # A worker's line may follow output that the distributed runtime wrote to stdout without a newline (seen
    # once in CI on process 0), so take each record from where its JSON starts.
    return [json.loads(line[line.index(start) :]) for line in out.splitlines() if start in line]


def test_every_decision_and_deletion_is_process_0s_once_on_disk_and_in_a_bucket(run_workers, tmp_path, s3_server):
    steps = 14
    bucket = Bucket(s3_server, s3_server.new_bucket("policy"))
    roots = [str(tmp_path), bucket.url("run/checkpoints")]
    outs = run_workers("mp_policy.py", str(steps), *roots, processes=2, devices=2)
    decisions = [worker_lines(out, '{"step"') for out in outs]
    assert decisions[0] == decisions[1], "processes took different decisions"

    expected = expected_saves(steps, interval=10, every=5, clock_rate=3)
    assert expected == {4: True, 5: False, 9: True, 10: False, 14: True}  # the schedule this test relies on
    deletions = [worker_lines(out, '{"deleted"') for out in outs]
    assert deletions[1] == []  # process 1 never deletes
    for root in roots:
        saved_steps = [d["step"] for d in decisions[0] if d["saved"] and d["root"] == root]
        assert saved_steps == sorted(expected)  # each decided step saved exactly once, nothing else
        # Temporary 4 and 9 were deleted, once each, once 5 and 10 were complete; the newest temporary stays.
        deleted = [d["deleted"] for d in deletions[0] if d["root"] == root]
        assert deleted == [f"{root}/step-4", f"{root}/step-9"]
        infos = dist_ckpt.list_checkpoints(root)
        assert [(info.step, info.committed, info.temporary) for info in infos] == [
            (5, True, False),
            (10, True, False),
            (14, True, True),
        ]
        w = dist_ckpt.load(f"{root}/step-14", {"w": np.zeros(16, np.float32), "step": 0})
        np.testing.assert_array_equal(w["w"], np.arange(16, dtype=np.float32) + 14)
        assert w["step"] == 14
    assert {key.split("/")[2] for key in bucket.keys("run/checkpoints/")} == {"step-5", "step-10", "step-14"}


def test_one_process_save_then_two_process_load_checks_every_shard(run_workers, tmp_path):
    ref = reference_arrays()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    tree = {"flat": {name: jax.device_put(ref[name], NamedSharding(mesh, P())) for name in ref}, "other": 1}
    tree["flat"]["embed"] = jax.device_put(ref["embed"], NamedSharding(mesh, P("d")))
    dist_ckpt.save(tree, tmp_path / "step-1", step=1, block=True)

    outs = run_workers("mp_load.py", str(tmp_path / "step-1"), processes=2, devices=4, timeout=120)
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert [r["process"] for r in reports] == [0, 1]
    assert all(r["shards_checked"] == 6 * 4 for r in reports)  # 6 leaves x 4 local devices, each compared
