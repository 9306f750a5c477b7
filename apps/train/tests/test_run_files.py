"""config.yaml in a run directory under each fault: written whole or not at all, with a sha256 that reading
checks; truncation, a flipped bit, a half-written file from a kill, a deleted file, no read permission and a
full disk each give one clear error naming the file and the fix, and leave the intact files as they were."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from lm_train.errors import CheckpointError, UserError
from lm_train.run.run_dir import CONFIG_CHECKSUM, RunPaths, read_run_config, write_run_files

CONFIG = "model:\n  type: gpt2\n  hidden_dim: 32\ntrainer:\n  num_train_steps: 4\n" * 20
TOKENIZER = b'{"version": "1.0"}'


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.fixture
def run(tmp_path):
    write_run_files(str(tmp_path / "run"), CONFIG, TOKENIZER)
    return RunPaths(tmp_path / "run")


def test_the_run_files_are_written_with_the_config_checksum_and_read_back(run):
    assert run.config_file.read_text() == CONFIG and run.tokenizer_file.read_bytes() == TOKENIZER
    recorded = (run.run_dir / CONFIG_CHECKSUM).read_text()
    assert recorded == hashlib.sha256(CONFIG.encode()).hexdigest()  # plain hashlib, not our code
    assert read_run_config(run) == run.config_file


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01  # "hidden_dim: 32" may become "hidden_dim: 33": still valid YAML
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip], ids=["truncated", "flipped"])
def test_a_damaged_config_is_named_with_the_fix_and_nothing_is_changed(run, damage):
    damage(run.config_file)
    before = _digests(run.run_dir)
    with pytest.raises(CheckpointError) as error:
        read_run_config(run)
    message = str(error.value)
    assert str(run.config_file) in message and "is damaged" in message and CONFIG_CHECKSUM in message, message
    assert "Put the config the run was started with in its place" in message
    assert _digests(run.run_dir) == before


def test_a_config_written_by_a_run_before_checksums_is_read_as_it_is(run):
    (run.run_dir / CONFIG_CHECKSUM).unlink()
    assert read_run_config(run) == run.config_file


def test_a_kill_during_the_write_leaves_the_previous_config_whole(run, tmp_path):
    before = _digests(run.run_dir)
    # A child process writes a much larger config and is killed mid-write (its fsync never returns); what it
    # leaves is at most a hidden temporary file, never a part of config.yaml.
    script = (
        "import os, sys, threading\n"
        "def hang(fd):\n"
        "    print('writing', flush=True); threading.Event().wait()\n"
        "os.fsync = hang\n"
        "from lm_train.run.run_dir import write_run_files\n"
        f"write_run_files({str(run.run_dir)!r}, 'x: 1\\n' * 200000, b'{{}}')\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
    finally:
        child.kill()
        child.wait()
    assert {k: v for k, v in _digests(run.run_dir).items() if not k.startswith(".")} == before
    assert read_run_config(run) == run.config_file


def test_a_deleted_config_names_the_checkpoint_and_what_it_needs(run):
    (run.run_dir / "checkpoints" / "step-2").mkdir(parents=True)
    run.config_file.unlink()
    with pytest.raises(CheckpointError) as error:
        RunPaths.of_checkpoint(run.run_dir / "checkpoints" / "step-2")
    assert "config.yaml" in str(error.value) and "lm-train run" in str(error.value), str(error.value)


def test_a_config_without_read_permission_is_named(run):
    run.config_file.chmod(0)
    try:
        if os.access(run.config_file, os.R_OK) and shutil.which("setpriv") is not None:
            # Root reads a mode-000 file: drop CAP_DAC_OVERRIDE in a child that does the read instead.
            code = (
                "from lm_train.run.run_dir import RunPaths, read_run_config\n"
                "from lm_train.errors import CheckpointError\n"
                f"try: read_run_config(RunPaths(__import__('pathlib').Path({str(run.run_dir)!r})))\n"
                "except CheckpointError as e: print(e)\n"
            )
            drop = [
                "setpriv",
                "--inh-caps=-dac_override,-dac_read_search",
                "--bounding-set=-dac_override,-dac_read_search",
            ]
            done = subprocess.run([*drop, sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            message = done.stdout
        elif os.access(run.config_file, os.R_OK):
            pytest.skip("this process reads a mode-000 file and setpriv is missing (not a permission test)")
        else:
            with pytest.raises(CheckpointError) as error:
                read_run_config(run)
            message = str(error.value)
        assert f"Reading {run.config_file} failed: Permission denied" in message, message
    finally:
        run.config_file.chmod(0o644)


def test_a_full_disk_fails_the_write_clearly_and_keeps_the_previous_files(tmp_path):
    mount = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root in a namespace that allows it): {done.stderr!r}")
    try:
        write_run_files(str(mount / "run"), CONFIG, TOKENIZER)
        before = _digests(mount / "run")
        with pytest.raises(UserError) as error:
            write_run_files(str(mount / "run"), "x: 1\n" * 40_000, TOKENIZER)  # 200 kB: more than the disk
        message = str(error.value)
        assert "config.yaml" in message and "no space left" in message and "are whole" in message, message
        assert _digests(mount / "run") == before  # the whole previous files, and no temporary left behind
        assert read_run_config(RunPaths(mount / "run")) == mount / "run" / "config.yaml"
    finally:
        subprocess.run(["umount", str(mount)], check=False)
