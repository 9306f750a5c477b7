"""The source snapshot of `lm-train launch`: what it copies from a real git checkout, and what it records."""

import hashlib
import subprocess
from pathlib import Path

import pytest

from lm_train.launch.prepared import passed_env
from lm_train.launch.snapshot import LaunchError, take_snapshot, warn_if_dirty


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A git checkout with a package's src folder, a committed file, an ignored file and nothing uncommitted."""
    root = tmp_path / "repo"
    (root / "packages" / "pkg" / "src" / "pkg").mkdir(parents=True)
    (root / "packages" / "pkg" / "src" / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (root / "README.md").write_text("hello\n")
    (root / ".gitignore").write_text("ignored.txt\n")
    git(root.parent, "init", "-q", str(root))
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    (root / "ignored.txt").write_text("not shipped\n")
    return root


def test_a_clean_checkout_is_copied_with_its_commit_and_no_diff(checkout, tmp_path):
    snapshot = take_snapshot(checkout, tmp_path / "out", require_clean=True)
    assert snapshot.commit == git(checkout, "rev-parse", "HEAD")
    assert snapshot.diff_sha256 is None and snapshot.dirty_files == ()
    assert sorted(snapshot.files) == [".gitignore", "README.md", "packages/pkg/src/pkg/__init__.py"]
    assert not (tmp_path / "out" / "ignored.txt").exists()
    assert snapshot.source_dirs() == ["packages/pkg/src"]
    assert warn_if_dirty(snapshot) is None


def test_uncommitted_changes_are_shipped_named_and_hashed(checkout, tmp_path):
    (checkout / "README.md").write_text("changed\n")
    (checkout / "new.py").write_text("x = 2\n")
    snapshot = take_snapshot(checkout, tmp_path / "out")
    assert (tmp_path / "out" / "README.md").read_text() == "changed\n"  # the working tree, not the commit
    assert (tmp_path / "out" / "new.py").read_text() == "x = 2\n"
    assert snapshot.dirty_files == ("README.md", "new.py")
    # The reference: git's own diff, then the untracked file's name and bytes.
    diff = subprocess.run(["git", "-C", str(checkout), "diff", "HEAD", "--binary"], capture_output=True).stdout
    assert snapshot.diff_sha256 == hashlib.sha256(diff + b"\0new.py\0x = 2\n").hexdigest()
    warning = warn_if_dirty(snapshot)
    assert "README.md, new.py" in warning and snapshot.commit[:12] in warning
    (checkout / "new.py").write_text("x = 3\n")
    assert take_snapshot(checkout, tmp_path / "again").diff_sha256 != snapshot.diff_sha256


def test_require_clean_refuses_a_dirty_checkout_naming_its_files(checkout, tmp_path):
    (checkout / "README.md").write_text("changed\n")
    with pytest.raises(LaunchError, match=r"uncommitted changes \(README\.md\) and --require-clean") as refused:
        take_snapshot(checkout, tmp_path / "out", require_clean=True)
    assert "git stash -u" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_the_environment_that_configures_a_run_is_passed_and_the_launchers_own_is_not():
    environ = {
        "LM_TRAIN_STEP_DELAY_S": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--x",
        "WANDB_MODE": "offline",
        "AWS_REGION": "r",
        "HF_HOME": "/h",
        "STORAGE_EMULATOR_HOST": "http://e",
        "LM_TRAIN_PROCESS_ID": "3",
        "LM_TRAIN_COORDINATOR_ADDRESS": "a:1",
        "LM_TRAIN_NUM_PROCESSES": "4",
        "HOME": "/root",
        "PATH": "/bin",
    }
    passed = ["LM_TRAIN_STEP_DELAY_S", "JAX_PLATFORMS", "XLA_FLAGS", "WANDB_MODE", "AWS_REGION", "HF_HOME"]
    assert passed_env(environ) == {k: environ[k] for k in [*passed, "STORAGE_EMULATOR_HOST"]}
