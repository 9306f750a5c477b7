"""Chunks written with plain file writes (a local, checksummed save) are byte for byte the files that tensorstore's
zarr3 `bytes` + `crc32c` codecs write for the same array, and plain tensorstore reads them, checking each crc32c.

The reference is tensorstore itself: the same arrays written through it with the spec that dist_ckpt records,
into another directory, then every file compared."""

import gc
import json
import os
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt
from dist_ckpt.direct_write import DirectWrites
from dist_ckpt.location import Location
from dist_ckpt.storage import array_spec
from dist_ckpt.workers import Workers


def put(value, shape, names, spec):
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    return jax.device_put(value, NamedSharding(mesh, spec))


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "rows": rng.standard_normal((64, 96)).astype(np.float32),  # shards split by columns: not contiguous
        "cols": rng.standard_normal((16, 64)).astype(np.float32),  # one chunk per shard
        "bf16": rng.standard_normal((8, 32)).astype(ml_dtypes.bfloat16),
        "ints": rng.integers(-100, 100, (8, 4), dtype=np.int8),
        "mask": rng.integers(0, 2, (8, 8)).astype(np.bool_),
        "zeros": np.zeros((4, 4), np.float64),  # stored too, like every chunk
        "scalar": np.array(3.5, np.float32),  # 0-d: one chunk, key "c"
    }


def tensorstore_reference(checkpoint: Path, name: str, value: np.ndarray, out: Path) -> Path:
    """`value` written by plain tensorstore with the metadata dist_ckpt stored for `name`, under `out`."""
    metadata = json.loads((checkpoint / "arrays" / name / "zarr.json").read_text())
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(out / name) + "/"},
        "metadata": {k: metadata[k] for k in ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs")},
        "store_data_equal_to_fill_value": True,
    }
    store = ts.open(spec, create=True).result()
    store.write(value).result()
    return out / name


def files_under(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_saved_chunk_files_are_the_bytes_tensorstore_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(dist_ckpt.storage, "MAX_CHUNK_BYTES", 1024)  # several chunks in some shards
    values = arrays()
    tree = {
        **values,
        "rows": put(values["rows"], (8,), ("d",), P("d")),
        "cols": put(values["cols"], (2, 4), ("a", "b"), P("a", "b")),
        "bf16": put(values["bf16"], (2, 4), ("a", "b"), P(None, "b")),
    }
    dist_ckpt.save(tree, tmp_path / "ck", step=1, block=True, progress=False)
    manifest = dist_ckpt.read_manifest(tmp_path / "ck")
    chunk_shapes = {e["array"]: e["chunk_shape"] for e in manifest["leaves"] if e["kind"] == "array"}
    assert chunk_shapes["rows"] == [8, 24] and chunk_shapes["cols"] == [8, 16]  # rows: 4 chunks per 8 x 96 shard
    for name, value in values.items():
        ours = files_under(tmp_path / "ck/arrays" / name)
        reference = files_under(tensorstore_reference(tmp_path / "ck", name, value, tmp_path / "ts"))
        assert sorted(ours) == sorted(reference), name  # same chunk keys, nothing extra (no temporary files)
        assert len(ours) > 1
        differing = [key for key in ours if ours[key] != reference[key]]
        assert differing == [], (name, differing)
        # Plain tensorstore, with its crc32c codec checking every chunk, reads what dist_ckpt wrote.
        store = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/ck/arrays/{name}/"}).result()
        assert [c["name"] for c in store.codec.to_json()["codecs"]] == ["bytes", "crc32c"]
        assert store.read().result().tobytes() == value.tobytes(), name
    loaded = dist_ckpt.load(tmp_path / "ck", progress=False)
    assert all(loaded[f"['{name}']"].tobytes() == value.tobytes() for name, value in values.items())


def test_an_edge_chunk_is_padded_with_zeros_as_tensorstore_pads_it(tmp_path):
    """A chunk grid that overhangs the array (dist_ckpt's own chunk shapes tile shards, but the writer must not
    depend on it): the last chunk is stored whole, the overhang zero, as tensorstore stores it."""
    value = np.arange(30, dtype=np.float32).reshape(10, 3) + 1
    entry = {"array": "edge", "shape": [10, 3], "chunk_shape": [4, 3]}
    location = Location.parse(tmp_path / "ck")
    spec = array_spec(location, "edge", ocdbt=False, dtype=value.dtype, shape=[10, 3], chunk_shape=[4, 3])
    ts.open(spec, create=True).result()  # the metadata, as process 0 writes it
    writes = DirectWrites(location)
    writes.prepare(entry)
    writes.start_region(entry, ((0, 10), (0, 3)), value)
    crcs = writes.finish()["edge"]
    assert sorted(crcs) == [0, 1, 2]
    reference = tensorstore_reference(tmp_path / "ck", "edge", value, tmp_path / "ts")
    assert files_under(tmp_path / "ck/arrays/edge") == files_under(reference)
    assert (tmp_path / "ck/arrays/edge/c/2/0").stat().st_size == 4 * 3 * 4 + 4
    store = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/ck/arrays/edge/"}).result()
    assert store.read().result().tolist() == value.tolist()


def test_a_failed_chunk_write_names_the_file_and_leaves_no_write_behind(tmp_path):
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    entry = {"array": "w", "shape": [8, 8], "chunk_shape": [2, 8]}
    location = Location.parse(tmp_path / "ck")
    writes = DirectWrites(location)
    writes.prepare(entry)
    (tmp_path / "ck/arrays/w/c").write_text("a file where a directory must be")
    writes.start_region(entry, ((0, 8), (0, 8)), value)
    with pytest.raises(dist_ckpt.StorageError) as caught:
        writes.finish()
    writes.abandon()
    assert str(tmp_path / "ck/arrays/w/c/") in caught.value.url and "Could not write" in str(caught.value)
    assert all(future.done() for _, _, future in writes.pending)


def test_an_array_directory_that_cannot_be_made_is_a_storage_error_naming_it(tmp_path):
    (tmp_path / "ck/arrays").mkdir(parents=True)
    (tmp_path / "ck/arrays/w").write_text("a file where the array's directory must be")
    with pytest.raises(dist_ckpt.StorageError) as caught:
        DirectWrites(Location.parse(tmp_path / "ck")).prepare({"array": "w"})
    assert caught.value.url == str(tmp_path / "ck/arrays/w") and "Could not create" in str(caught.value)
    assert (tmp_path / "ck/arrays/w").read_text() == "a file where the array's directory must be"


def save_then_end(path: Path, then: str) -> subprocess.CompletedProcess:
    """A program that saves and ends at once; its chunk writes start only after its main thread has ended."""
    script = (
        "import sys, time\n"
        "import numpy as np\n"
        "import dist_ckpt, dist_ckpt.direct_write as dw\n"
        "start_region = dw.DirectWrites.start_region\n"
        "def late(self, *args):\n"
        "    time.sleep(0.5)\n"
        f"    {then}\n"
        "dw.DirectWrites.start_region = late\n"
        "dist_ckpt.save({'w': np.arange(1024.0)}, sys.argv[1], step=1, progress=False)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def test_a_program_that_ends_right_after_save_still_commits_it(tmp_path):
    """The chunk writes must still run, and the checkpoint be committed, as when tensorstore wrote the chunks
    (on Python 3.12 no thread can be started by then: the writers are started by save())."""
    done = save_then_end(tmp_path / "step-1", "return start_region(self, *args)")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "step-1" / "COMMITTED").is_file()
    assert dist_ckpt.load(tmp_path / "step-1", progress=False)["['w']"].tolist() == list(np.arange(1024.0))


def test_a_save_that_fails_after_the_program_ended_says_so(tmp_path):
    """Nobody is left to wait() for it, so the failure is printed, not lost; nothing is committed."""
    done = save_then_end(tmp_path / "step-1", "raise OSError('the disk went away')")
    assert "failed after the program ended: OSError: the disk went away" in done.stderr, done.stderr[-3000:]
    assert "step 1" in done.stderr and not (tmp_path / "step-1" / "COMMITTED").exists()


def test_a_load_started_on_its_own_thread_as_the_program_ends_still_reads(tmp_path):
    dist_ckpt.save({"w": np.arange(256.0)}, tmp_path / "step-1", step=1, block=True, progress=False)
    script = (
        "import sys, threading, time\n"
        "import numpy as np\n"
        "import dist_ckpt\n"
        "def late():\n"
        "    time.sleep(0.5)\n"
        "    w = dist_ckpt.load(sys.argv[1], progress=False)[\"['w']\"]\n"
        "    open(sys.argv[2], 'w').write(str(float(np.sum(w))))\n"
        "threading.Thread(target=late).start()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "step-1"), str(tmp_path / "sum")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "sum").read_text() == str(float(np.arange(256.0).sum()))


def test_a_call_runs_in_the_submitting_thread_where_no_thread_can_start(monkeypatch):
    workers = Workers(2)

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert workers.submit(threading.get_ident).result(timeout=5) == threading.get_ident()
    assert workers.started == 0


def test_no_host_copy_outlives_the_save(tmp_path):
    """The writer threads, idle after a save, hold nothing of it: the snapshot's host copy is freed."""
    dist_ckpt.save({"w": np.zeros(4)}, tmp_path / "step-0", step=0, block=True, progress=False)  # threads started
    data = np.arange(2**22, dtype=np.float32)  # 16 MiB
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        dist_ckpt.save({"w": data}, tmp_path / "step-1", step=1, block=True, progress=False)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2**20, f"{held / 2**20:.1f} MiB still held after the save"
