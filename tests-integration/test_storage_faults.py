"""Storage faults under `lm-train`: a checkpoint save that runs out of disk, a tokenizer trained into a full cache
directory, and a checkpoint manifest or run config.yaml without read permission. Each stops the command with one
paragraph naming the file and the fix (exit 2, no traceback) and leaves nothing that a later run would trust, and
nothing intact modified; once there is room, the rerun resumes from what was intact."""

from __future__ import annotations

import base64
import hashlib
import json
import warnings
from pathlib import Path

import crc32c
import numpy as np
import pytest
import tensorstore as ts
from cli_checks import assert_clear_error, tree_digest

import dist_ckpt

pytestmark = pytest.mark.slow


def assert_intact(checkpoint: Path) -> None:
    """Without dist_ckpt: the commit marker's digest of the manifest, and every chunk file's crc32c against the
    manifest's digests; then plain tensorstore reads every array (checking each chunk's stored crc32c itself)."""
    manifest_bytes = (checkpoint / "manifest.json").read_bytes()
    commit = json.loads((checkpoint / "COMMITTED").read_text())
    assert commit["manifest_crc32c"] == crc32c.crc32c(manifest_bytes)
    arrays = [e for e in json.loads(manifest_bytes)["leaves"] if e["kind"] == "array"]
    assert arrays
    for entry in arrays:
        folder = checkpoint / "arrays" / entry["array"]
        recorded = np.frombuffer(base64.b64decode(entry["chunk_crc32c"]), "<u4")
        grid = [-(-size // chunk) for size, chunk in zip(entry["shape"], entry["chunk_shape"], strict=True)]
        # A scalar's one chunk is the file `c` itself.
        chunks = [folder / "c"] if not grid else sorted(p for p in (folder / "c").rglob("*") if p.is_file())
        assert len(chunks) == len(recorded) == int(np.prod(grid)), entry["path"]
        for chunk in chunks:
            raw = chunk.read_bytes()
            cell = tuple(int(i) for i in chunk.relative_to(folder / "c").parts)
            expected = int(recorded[np.ravel_multi_index(cell, grid)] if grid else recorded[0])
            assert crc32c.crc32c(raw[:-4]) == int.from_bytes(raw[-4:], "little") == expected, chunk
        store = ts.open({"driver": "zarr3", "kvstore": f"file://{folder}/", "fill_missing_data_reads": False}).result()
        assert store.read().result().shape == tuple(entry["shape"])


def test_a_checkpoint_save_onto_a_full_disk_stops_the_run_and_the_rerun_resumes(
    tiny_project, cli, small_disk, tmp_path
):
    # One checkpoint of the tiny model takes ~2.2 MiB of tmpfs pages (~470 files): step-2 fits in 3 MiB, step-4 not.
    disk = small_disk("3m")
    root = disk.path / "ckpt"
    args = ["run", str(tiny_project.config), "--trainer.run_dir", str(tmp_path / "run")]
    args += ["--trainer.checkpointer.base_path", str(root), "--trainer.num_train_steps", "4"]
    failed = cli(args, tiny_project.root)
    assert_clear_error(
        failed,
        "Training stopped at step 4",
        f"the disk is full (writing {root / 'step-4'}/",
        f"Free space under {root}, or point trainer.checkpointer.base_path at a disk with room",
        f"it resumes from {root / 'step-2'}, the newest complete checkpoint",
    )
    assert (root / "step-4").is_dir() and not (root / "step-4" / "COMMITTED").exists()
    with pytest.warns(dist_ckpt.TornCheckpointWarning, match="step-4"):
        assert dist_ckpt.latest(root) == root / "step-2"
    assert_intact(root / "step-2")
    before = tree_digest(root / "step-2")

    disk.resize("16m")  # space freed: the same command resumes from step-2 and replaces the torn step-4
    resumed = cli(args, tiny_project.root)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resuming from {root / 'step-2'}" in resumed.stderr
    assert tree_digest(root / "step-2") == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing torn is left
        assert dist_ckpt.latest(root) == root / "step-4"
    assert_intact(root / "step-4")
    assert dist_ckpt.read_manifest(root / "step-4")["step"] == 4


def test_a_tokenizer_trained_into_a_full_cache_dir_is_a_clear_error_and_leaves_nothing(
    tiny_project, cli, small_disk, tmp_path
):
    disk = small_disk("16k")
    (disk.path / "filler").write_bytes(bytes(12 * 1024))  # one 4 KiB page left: the tokenizer (~8 KiB) does not fit
    cache = disk.path / "cache"
    model = tiny_project.config.read_text(encoding="utf-8").split("model:", 1)[1]
    config = tiny_project.write_config(
        "builtin-small-disk.yaml",
        f"data:\n  builtin: python_stdlib\n  vocab_size: 300\n  cache_dir: {cache}\nmodel:{model}",
    )
    failed = cli(["run", str(config), "--trainer.run_dir", str(tmp_path / "run")], tiny_project.root)
    assert_clear_error(failed, str(cache / "tokenizer-bpe300.json"), "data.cache_dir")
    assert disk.used_files() == ["filler"]  # no tokenizer, whole or partial, and no temporary file
    assert not (tmp_path / "run").exists()

    # With a tokenizer given, the cache build is what fails, in its background thread, before its first chunk:
    # the run stops with the build's error at once (it waited an hour for that chunk before).
    given = tiny_project.write_config(
        "given-tokenizer-small-disk.yaml",
        f"data:\n  train_urls: [data/train_0.jsonl]\n  tokenizer: tokenizer.json\n  cache_dir: {cache}\nmodel:{model}",
    )
    stuck = cli(["run", str(given), "--trainer.run_dir", str(tmp_path / "run")], tiny_project.root, timeout=300)
    assert_clear_error(stuck, "its build in this process failed", "no space left on the device", str(cache))


def test_files_without_read_permission_are_named_with_the_fix_and_left_as_they_were(
    tiny_project, cli_obeying_file_modes, tmp_path
):
    run_dir = tmp_path / "run"
    # A committed checkpoint to resume from: its manifest is read before any array, so what it holds does not matter.
    dist_ckpt.save({"x": np.zeros(3)}, run_dir / "checkpoints" / "step-1", step=1, block=True, progress=False)
    config_text = tiny_project.config.read_bytes()
    (run_dir / "config.yaml").write_bytes(config_text)
    (run_dir / "config.yaml.sha256").write_text(hashlib.sha256(config_text).hexdigest())
    manifest, config = run_dir / "checkpoints" / "step-1" / "manifest.json", run_dir / "config.yaml"
    before = tree_digest(run_dir)
    for file in (manifest, config):
        file.chmod(0)
    try:
        resume = cli_obeying_file_modes(
            ["run", str(tiny_project.config), "--trainer.run_dir", str(run_dir)], tiny_project.root
        )
        rerun = cli_obeying_file_modes(["run", str(config)], tiny_project.root)  # resuming with the run's own config
        sample = cli_obeying_file_modes(["sample", str(run_dir / "checkpoints" / "step-1")], tiny_project.root)
    finally:
        for file in (manifest, config):
            file.chmod(0o644)
    assert_clear_error(resume, f"Could not read {manifest}", "Permission denied", "fix the file's permissions")
    assert_clear_error(rerun, f"Config file {config} cannot be read: Permission denied", "chmod a+r")
    assert_clear_error(sample, f"Reading {config} failed: Permission denied", "Give this user access to it")
    assert tree_digest(run_dir) == before  # nothing quarantined, rewritten or added
