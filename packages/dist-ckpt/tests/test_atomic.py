"""Atomic commits: a SIGKILL mid-save leaves the previous checkpoint loadable; discovery skips torn ones."""

import hashlib
import os
import signal
import time

import numpy as np
import pytest

import dist_ckpt


def wait_for_chunk_files(directory, timeout=60.0):
    """Poll until some array data of the save in progress is on disk (the save is truly under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        arrays = directory / "arrays"
        if arrays.is_dir() and any(p.is_file() and p.name != "zarr.json" for p in arrays.rglob("*")):
            return
        time.sleep(0.002)
    raise AssertionError(f"no chunk file appeared under {directory} within {timeout} s")


def file_digests(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(start_worker, tmp_path):
    proc = start_worker("kill_during_save.py", str(tmp_path))
    assert proc.stdout.readline().strip() == "SAVING", proc.stderr.read()
    intact = file_digests(tmp_path / "step-1")
    wait_for_chunk_files(tmp_path / "step-2")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    torn = tmp_path / "step-2"
    assert not (torn / "COMMITTED").exists(), "the save finished before the kill: make the worker's tree larger"
    assert any(p.is_file() for p in (torn / "arrays").rglob("*"))  # killed mid-write, some bytes are there
    with pytest.warns(dist_ckpt.TornCheckpointWarning, match=r"Skipping torn checkpoint .*step-2"):
        found = dist_ckpt.latest(tmp_path)
    assert found == tmp_path / "step-1"
    loaded = dist_ckpt.load(found, {"w": np.zeros(64, np.float32), "step": 0})
    assert loaded["w"].tobytes() == np.arange(64, dtype=np.float32).tobytes() and loaded["step"] == 1
    with pytest.raises(dist_ckpt.CheckpointError, match=r"step-2 has no commit marker.*Load an earlier checkpoint"):
        dist_ckpt.load(torn)
    with pytest.raises(dist_ckpt.CheckpointError, match="no commit marker"):
        dist_ckpt.verify(torn)
    assert dist_ckpt.resolve_checkpoint(torn) is None
    assert file_digests(tmp_path / "step-1") == intact  # the kill touched nothing of the committed checkpoint
    dist_ckpt.verify(found, read_data=True)

    # Resuming from step 1 and saving step 2 again replaces the torn directory.
    with pytest.warns(UserWarning, match="Replacing torn checkpoint"):
        dist_ckpt.save({"w": np.ones(3, np.float32)}, torn, step=2, block=True)
    assert dist_ckpt.latest(tmp_path) == torn
    assert dist_ckpt.load(torn)["['w']"].tolist() == [1.0, 1.0, 1.0]


def test_latest_picks_the_newest_complete_by_step_number(tmp_path):
    for step in (2, 10, 9):  # 10 > 9 numerically, though "step-10" < "step-9" as text
        dist_ckpt.save({"s": step}, tmp_path / f"step-{step}", step=step, block=True)
    (tmp_path / "step-11").mkdir()  # torn: no marker
    (tmp_path / "notes").mkdir()  # not a checkpoint at all
    with pytest.warns(dist_ckpt.TornCheckpointWarning, match="step-11"):
        assert dist_ckpt.latest(tmp_path) == tmp_path / "step-10"
    assert [(i.step, i.committed) for i in dist_ckpt.list_checkpoints(tmp_path)] == [
        (2, True),
        (9, True),
        (10, True),
        (11, False),
    ]


def test_latest_of_an_empty_or_missing_root_is_none_unless_required(tmp_path):
    assert dist_ckpt.latest(tmp_path / "missing") is None
    assert dist_ckpt.latest(tmp_path) is None
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="Asked to resume, but there is no complete"):
        dist_ckpt.latest(tmp_path, required=True)


def test_required_latest_with_only_torn_checkpoints_names_them(tmp_path):
    (tmp_path / "step-5").mkdir()
    with (
        pytest.warns(dist_ckpt.TornCheckpointWarning),
        pytest.raises(dist_ckpt.CheckpointNotFoundError, match=r"Torn .*step-5"),
    ):
        dist_ckpt.latest(tmp_path, required=True)


def test_commit_marker_is_written_last_and_readable_by_others(tmp_path):
    dist_ckpt.save({"x": np.arange(3)}, tmp_path / "step-1", step=1, block=True)
    marker = tmp_path / "step-1" / "COMMITTED"
    assert marker.stat().st_mtime_ns >= max(p.stat().st_mtime_ns for p in (tmp_path / "step-1").rglob("*"))
    assert marker.stat().st_mode & 0o044 == 0o044


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_checkpoint_gets_the_modes_the_umask_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = tmp_path / f"umask-{umask:o}" / "step-1"
        dist_ckpt.save({"w": np.arange(12.0).reshape(3, 4)}, path, step=1, block=True)
    finally:
        os.umask(old)
    wrong = [
        f"{p.relative_to(tmp_path)}: {oct(p.stat().st_mode & 0o777)}"
        for p in [path, *path.rglob("*")]
        if p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~umask
    ]
    assert len(list(path.rglob("*"))) > 3
    assert wrong == []
