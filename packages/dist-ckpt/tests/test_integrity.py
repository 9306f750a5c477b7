"""Checksummed checkpoints: every chunk carries its crc32c and the manifest each array's digest; damaged files
(truncated, a flipped bit, deleted, replaced, unreadable, a full disk) give a CorruptCheckpointError or
StorageError naming the file and the fix, nothing intact is modified, and quarantine moves a damaged one away."""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import crc32c
import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dist_ckpt
import storage_io

FIXTURES = Path(__file__).parent / "fixtures"
WORKERS = Path(__file__).parent / "workers"
W = "['params']['w']"


def values(step: int) -> np.ndarray:
    return np.arange(64 * 16, dtype=np.float32).reshape(64, 16) + step


def tree(step: int) -> dict:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    return {
        "params": {"w": jax.device_put(values(step), NamedSharding(mesh, P("d")))},  # 8 chunks of 8 x 16
        "opt": {"mu": np.zeros((8, 8), np.float32)},  # all zeros: stored all the same
        "step": step,
    }


def target(spec=P("d")) -> dict:
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, spec)
    return {
        "params": {"w": jax.ShapeDtypeStruct((64, 16), np.float32, sharding=sharding)},
        "opt": {"mu": np.zeros((8, 8), np.float32)},
        "step": 0,
    }


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`: what "nothing intact is modified" is checked against."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.fixture
def root(tmp_path) -> Path:
    for step in (1, 2):
        dist_ckpt.save(tree(step), tmp_path / f"step-{step}", step=step, block=True, progress=False)
    return tmp_path


def assert_intact_neighbour(root: Path, before: dict[str, str]) -> None:
    """step-1 is byte for byte what it was, and loads."""
    assert file_digests(root / "step-1") == before
    loaded = dist_ckpt.load(root / "step-1", target(), progress=False)
    assert np.asarray(loaded["params"]["w"]).tobytes() == values(1).tobytes()


def test_chunks_end_with_their_crc32c_and_the_manifest_records_them(root):
    zarr = json.loads((root / "step-2/arrays/params.w/zarr.json").read_text())
    assert [codec["name"] for codec in zarr["codecs"]] == ["bytes", "crc32c"]
    entry = next(e for e in dist_ckpt.read_manifest(root / "step-2")["leaves"] if e["path"] == W)
    recorded = np.frombuffer(base64.b64decode(entry["chunk_crc32c"]), "<u4").tolist()
    stored, expected = [], []
    for row in range(8):
        raw = (root / f"step-2/arrays/params.w/c/{row}/0").read_bytes()
        assert raw[:-4] == values(2)[row * 8 : (row + 1) * 8].tobytes()  # plain little-endian floats
        stored.append(int.from_bytes(raw[-4:], "little"))
        expected.append(crc32c.crc32c(values(2)[row * 8 : (row + 1) * 8].tobytes()))
    assert stored == expected == recorded
    assert (root / "step-2/arrays/opt.mu/c/0/0").stat().st_size == 8 * 8 * 4 + 4  # zeros are stored too
    store = ts.open({"driver": "zarr3", "kvstore": f"file://{root}/step-2/arrays/params.w/"}).result()
    assert store.read().result().tobytes() == values(2).tobytes()
    commit = json.loads((root / "step-2/COMMITTED").read_text())
    assert commit["manifest_crc32c"] == crc32c.crc32c((root / "step-2/manifest.json").read_bytes())
    assert dist_ckpt.verify(root / "step-2", read_data=True)["step"] == 2


def test_checksums_can_be_left_out(tmp_path):
    dist_ckpt.save(tree(5), tmp_path / "step-5", step=5, checksums=False, block=True)
    zarr = json.loads((tmp_path / "step-5/arrays/params.w/zarr.json").read_text())
    assert [codec["name"] for codec in zarr["codecs"]] == ["bytes"]
    assert (tmp_path / "step-5/arrays/params.w/c/0/0").stat().st_size == 8 * 16 * 4
    assert all("chunk_crc32c" not in e for e in dist_ckpt.read_manifest(tmp_path / "step-5")["leaves"])
    loaded = dist_ckpt.load(tmp_path / "step-5", target(P(None, "d")))
    assert np.asarray(loaded["params"]["w"]).tobytes() == values(5).tobytes()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:7])


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def delete(path: Path) -> None:
    path.unlink()


def replace_with_its_neighbour(path: Path) -> None:
    path.write_bytes((path.parent.parent / "4" / "0").read_bytes())  # a valid chunk, but another one


FAULTS = {
    "truncated": (truncate, "is truncated"),
    "flipped_bit": (flip_a_bit, "fails its checksum"),
    "deleted": (delete, "is missing"),
    "replaced": (replace_with_its_neighbour, "is not the one the manifest records"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_chunk_is_named_with_its_leaf_and_nothing_intact_changes(root, fault):
    damage, what = FAULTS[fault]
    victim = root / "step-2/arrays/params.w/c/3/0"
    neighbour = file_digests(root / "step-1")
    damage(victim)
    after_damage = file_digests(root / "step-2")
    # Plain tensorstore, as an independent reader, sees the same damage, except the replaced chunk: valid on its
    # own, only the manifest's digest tells it from the chunk that was saved.
    spec = {"driver": "zarr3", "kvstore": f"file://{root}/step-2/arrays/params.w/", "fill_missing_data_reads": False}
    plain = ts.open(spec).result()
    if fault == "replaced":
        assert plain[24:32].read().result().tobytes() == values(2)[32:40].tobytes()
    else:
        with pytest.raises(ValueError, match="c/3/0"):
            plain.read().result()
    for load_target in (target(), target(P(None, "d")), None):  # a resume, a reshard, a flat read
        with pytest.raises(dist_ckpt.CorruptCheckpointError) as caught:
            dist_ckpt.load(root / "step-2", load_target, progress=False)
        error = caught.value
        assert (error.file, error.key, error.path) == (str(victim), W, str(root / "step-2"))
        assert what in str(error) and "dist_ckpt.quarantine(" in str(error) and "\n" not in str(error)
    if fault == "flipped_bit":  # the stored checksum is intact: only reading the chunk finds it
        dist_ckpt.verify(root / "step-2")
    else:
        with pytest.raises(dist_ckpt.CorruptCheckpointError, match=what):
            dist_ckpt.verify(root / "step-2")
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match="c/3/0"):
        dist_ckpt.verify(root / "step-2", read_data=True)
    assert file_digests(root / "step-2") == after_damage  # loading and verifying wrote nothing
    assert_intact_neighbour(root, neighbour)


def test_damaged_manifest_markers_and_array_metadata_are_named(root):
    step2 = root / "step-2"
    manifest, commit, zarr = step2 / "manifest.json", step2 / "COMMITTED", step2 / "arrays/params.w/zarr.json"
    pristine = {p: p.read_bytes() for p in (manifest, commit, zarr)}
    cases = [
        (manifest, flip_a_bit, manifest, "does not match the checksum"),
        (manifest, truncate, manifest, "does not match the checksum"),
        (manifest, delete, manifest, "is missing although the checkpoint is committed"),
        (commit, truncate, commit, "is not valid JSON"),
        (zarr, truncate, zarr, "cannot be decoded"),
        (zarr, delete, zarr, "is missing"),
    ]
    for file, damage, named, what in cases:
        damage(file)
        with pytest.raises(dist_ckpt.CorruptCheckpointError, match=what) as caught:
            dist_ckpt.load(step2, progress=False)
        assert caught.value.file == str(named), (file.name, damage.__name__)
        assert caught.value.key == (W if file == zarr else None)
        file.write_bytes(pristine[file])
    truncate(commit)  # an unreadable commit marker: discovery skips it as corrupt
    with pytest.warns(dist_ckpt.TornCheckpointWarning, match=r"step-2: it was marked corrupt"):
        assert dist_ckpt.latest(root) == root / "step-1"
    assert [(i.step, i.committed, i.corrupt) for i in dist_ckpt.list_checkpoints(root)] == [
        (1, True, False),
        (2, False, True),
    ]


def test_quarantine_moves_a_damaged_checkpoint_away_and_resume_falls_back(root):
    delete(root / "step-2/arrays/params.w/c/0/0")
    neighbour = file_digests(root / "step-1")
    # The fallback a trainer runs on resume: the newest checkpoint that loads, quarantining the damaged ones.
    resumed = None
    while resumed is None and (found := dist_ckpt.latest(root)) is not None:
        try:
            resumed = dist_ckpt.load(found, target(), progress=False)
        except dist_ckpt.CorruptCheckpointError as error:
            moved = dist_ckpt.quarantine(found, reason=error)
    assert resumed["step"] == 1 and moved == root / "step-2.corrupt"
    assert not (root / "step-2").exists() and not (moved / "COMMITTED").exists()
    marker = json.loads((moved / "CORRUPT").read_text())
    assert marker["key"] == W and "c/0/0" in marker["reason"] and marker["quarantined_to"] == str(moved)
    assert dist_ckpt.resolve_checkpoint(root) == root / "step-1"
    assert dist_ckpt.resolve_checkpoint(moved) is None
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match="was marked corrupt"):
        dist_ckpt.load(moved)
    assert_intact_neighbour(root, neighbour)
    dist_ckpt.save(tree(2), root / "step-2", step=2, block=True)  # training reaches step 2 again
    assert dist_ckpt.quarantine(root / "step-2") == root / "step-2.corrupt-2"  # the first copy is kept
    assert (root / "step-2.corrupt" / "CORRUPT").is_file()


def test_a_checkpoint_of_dist_ckpt_0_1_without_checksums_still_loads(tmp_path):
    shutil.copytree(FIXTURES / "dist-ckpt-0.1.1", tmp_path / "old")
    zeros = [p for p in (tmp_path / "old/step-3/arrays/zeros").rglob("*") if p.is_file()]
    assert [p.name for p in zeros] == ["zarr.json"]  # 0.1 stored no chunk of zeros
    assert dist_ckpt.latest(tmp_path / "old") == tmp_path / "old/step-3"
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    old_target = {
        "name": "",
        "params": {
            "b": np.zeros(5, np.float16),
            "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("d"))),
        },
        "step": 0,
        "zeros": np.ones((4, 4), np.int32),
    }
    loaded = dist_ckpt.load(tmp_path / "old/step-3", old_target, progress=False)
    assert np.asarray(loaded["params"]["w"]).tobytes() == np.arange(32, dtype=np.float32).reshape(8, 4).tobytes()
    assert loaded["params"]["b"].tobytes() == np.linspace(-1, 1, 5).astype(np.float16).tobytes()
    assert loaded["zeros"].tolist() == [[0] * 4] * 4 and (loaded["step"], loaded["name"]) == (3, "old-format")
    assert dist_ckpt.verify(tmp_path / "old/step-3", read_data=True)["metadata"] == {"written_by": "dist-ckpt 0.1.1"}


# Root reads any file whatever its mode; without these two capabilities it obeys the permission bits.
WITHOUT_FILE_ACCESS_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("file", ["arrays/params.w/c/5/0", "manifest.json"])
def test_a_file_without_read_permission_is_named(root, file):
    victim = root / "step-2" / file
    victim.chmod(0)
    before = file_digests(root)
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing, so root cannot be kept from reading a mode-000 file")
    probe = subprocess.run([*WITHOUT_FILE_ACCESS_OVERRIDE, "cat", str(victim)], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("this process reads a mode-000 file even without CAP_DAC_OVERRIDE (not a permission test)")
    done = subprocess.run(
        [*WITHOUT_FILE_ACCESS_OVERRIDE, sys.executable, str(WORKERS / "load_report.py"), str(root / "step-2")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["type"] == "StorageError" and report["url"] == str(victim), report
    assert "Access was denied" in report["message"] and "permissions" in report["message"]
    assert "Permission denied" in report["message"] and "\n" not in report["message"] and report["reason"] == "denied"
    victim.chmod(0o644)
    assert file_digests(root) == before


def test_a_full_disk_fails_the_save_loudly_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root in a privileged machine): {mounted.stderr!r}")
    try:
        dist_ckpt.save({"w": np.arange(1024.0)}, disk / "step-1", step=1, block=True)
        before = file_digests(disk / "step-1")
        big = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(4)}  # 4 MiB on a 2 MiB disk
        with pytest.raises(dist_ckpt.BackgroundSaveError) as caught:
            dist_ckpt.save(big, disk / "step-2", step=2, block=True)
        cause = caught.value.__cause__
        assert isinstance(cause, dist_ckpt.StorageError) and cause.url.startswith(str(disk / "step-2"))
        assert cause.reason == "full"  # what lets a caller give its own fix
        assert "The disk is full" in str(caught.value) and "earlier checkpoints are intact" in str(caught.value)
        assert not (disk / "step-2" / "COMMITTED").exists()
        assert file_digests(disk / "step-1") == before
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dist_ckpt.TornCheckpointWarning)
            assert dist_ckpt.latest(disk) == disk / "step-1"
        assert dist_ckpt.load(disk / "step-1")["['w']"].tolist() == list(np.arange(1024.0))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_disk_that_fills_at_the_manifest_fails_the_save_and_leaves_no_manifest(tmp_path):
    """The arrays fit, the manifest does not: the save fails naming the manifest, and leaves no commit marker
    and no partial manifest."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root in a privileged machine): {mounted.stderr!r}")
    try:
        dist_ckpt.save({"w": np.arange(4.0)}, disk / "step-1", step=1, block=True, progress=False)
        before = file_digests(disk / "step-1")
        with pytest.raises(dist_ckpt.BackgroundSaveError) as caught:  # a 100 kB manifest on a 64 kB disk
            dist_ckpt.save({"w": np.arange(4.0)}, disk / "step-2", step=2, metadata={"pad": "x" * 100_000}, block=True)
        cause = caught.value.__cause__
        assert isinstance(cause, dist_ckpt.StorageError) and cause.reason == "full"
        assert cause.url == str(disk / "step-2" / "manifest.json") and "Free space" in str(cause)
        assert (disk / "step-2/arrays/w/c/0").is_file()  # the arrays were written: the manifest is what failed
        assert sorted(p.name for p in (disk / "step-2").iterdir()) == ["arrays"]  # no manifest, whole or partial
        assert file_digests(disk / "step-1") == before
        with pytest.warns(dist_ckpt.TornCheckpointWarning, match="step-2"):
            assert dist_ckpt.latest(disk) == disk / "step-1"
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_save_killed_while_writing_its_manifest_is_torn_and_skipped(tmp_path):
    """A real SIGKILL while the manifest is being written (its fsync never returns): what is left is a hidden
    temporary file and no commit marker, so the checkpoint is skipped and the previous one loads, unchanged."""
    dist_ckpt.save(tree(1), tmp_path / "step-1", step=1, block=True, progress=False)
    before = file_digests(tmp_path / "step-1")
    script = (
        "import os, sys, threading\n"
        "import numpy as np\n"
        "real_fsync = os.fsync\n"
        "def fsync(fd):\n"
        "    if '.manifest.json.' in os.readlink(f'/proc/self/fd/{fd}'):\n"
        "        print('writing', flush=True); threading.Event().wait()\n"
        "    real_fsync(fd)\n"
        "os.fsync = fsync\n"
        "import dist_ckpt\n"
        "dist_ckpt.save({'w': np.arange(64.0)}, sys.argv[1], step=2, block=True, progress=False)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "step-2")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.kill()
        child.wait(timeout=30)
    torn = tmp_path / "step-2"
    left = sorted(p.name for p in torn.iterdir())
    # The manifest's hidden temporary file (storage_io names it `.tmp-<random>.manifest.json.tmp`).
    assert left[0].startswith(storage_io.TMP_PREFIX) and ".manifest.json." in left[0], left
    assert left[1:] == ["arrays"], left
    with pytest.warns(dist_ckpt.TornCheckpointWarning, match=r"Skipping torn checkpoint .*step-2"):
        assert dist_ckpt.latest(tmp_path) == tmp_path / "step-1"
    with pytest.raises(dist_ckpt.CheckpointError, match=r"step-2 has no commit marker"):
        dist_ckpt.load(torn)
    assert_intact_neighbour(tmp_path, before)
