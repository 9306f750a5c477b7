"""The source snapshot a launch ships: the checkout's git-tracked files with their uncommitted changes."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lm_train.errors import UserError


class LaunchError(UserError):
    """A launch cannot start or go on: the cluster, the checkout or the restarts say why."""


@dataclass(frozen=True)
class Snapshot:
    """What was copied from a checkout, and which code it is."""

    root: Path
    """The checkout the files came from."""
    commit: str
    diff_sha256: str | None
    """sha256 of the uncommitted changes (tracked diff and untracked files); None: the tree was clean."""
    dirty_files: tuple[str, ...]
    files: tuple[str, ...]
    """Every copied file, relative to the root."""

    def source_dirs(self) -> list[str]:
        """The packages' and apps' src folders, relative to the root: what goes first on PYTHONPATH."""
        found = {str(Path(f).parent.parent) for f in self.files if _is_src_init(f)}
        return sorted(d for d in found if Path(d).name == "src")


def _is_src_init(file: str) -> bool:
    parts = Path(file).parts
    return len(parts) >= 3 and parts[-1] == "__init__.py" and parts[-3] == "src"


def _git(root: Path, *args: str) -> bytes:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=False)
    except FileNotFoundError:
        raise LaunchError(
            f"git is not installed, so the checkout {root} cannot be shipped. Install git on this machine."
        ) from None
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip()
        raise LaunchError(f"`git {' '.join(args)}` failed in {root}: {message}. Fix the checkout and launch again.")
    return done.stdout


def checkout_of(path: Path) -> Path | None:
    """The root of the git checkout holding `path`, or None when it is not in one (an installed wheel)."""
    done = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False
    )
    return Path(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else None


def _names(output: bytes) -> list[str]:
    return [name.decode() for name in output.split(b"\0") if name]


def dirty_files(root: Path) -> list[str]:
    """Tracked files changed since the commit, and untracked files git does not ignore."""
    changed = _names(_git(root, "diff", "HEAD", "--name-only", "-z"))
    untracked = _names(_git(root, "ls-files", "--others", "--exclude-standard", "-z"))
    return sorted(set(changed) | set(untracked))


def take_snapshot(root: Path, into: Path, *, require_clean: bool = False) -> Snapshot:
    """Copy the checkout's tracked and untracked-but-not-ignored files, as they are on disk, into `into`.

    `require_clean` refuses a checkout with uncommitted changes instead of shipping them."""
    commit = _git(root, "rev-parse", "HEAD").decode().strip()
    dirty = dirty_files(root)
    if dirty and require_clean:
        raise LaunchError(
            f"The checkout {root} has uncommitted changes ({_listed(dirty)}) and --require-clean was given. Commit "
            "or stash them (`git stash -u`), or launch without --require-clean to ship them with the commit."
        )
    files = [
        f
        for f in _names(_git(root, "ls-files", "--cached", "--others", "--exclude-standard", "-z"))
        if (root / f).is_file() and not (root / f).is_symlink()  # a deleted tracked file is not shipped
    ]
    for name in files:
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    return Snapshot(root, commit, _diff_hash(root, dirty) if dirty else None, tuple(dirty), tuple(files))


def _diff_hash(root: Path, dirty: list[str]) -> str:
    """sha256 of `git diff HEAD --binary`, then each untracked file's name and bytes: the same changes, the same
    hash on any machine."""
    digest = hashlib.sha256(_git(root, "diff", "HEAD", "--binary"))
    untracked = set(_names(_git(root, "ls-files", "--others", "--exclude-standard", "-z")))
    for name in sorted(untracked & set(dirty)):
        digest.update(b"\0" + name.encode() + b"\0")
        if (root / name).is_file():
            digest.update((root / name).read_bytes())
    return digest.hexdigest()


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def warn_if_dirty(snapshot: Snapshot) -> str | None:
    """The warning that names the uncommitted files shipped, or None for a clean checkout."""
    if not snapshot.dirty_files:
        return None
    assert snapshot.diff_sha256 is not None  # take_snapshot hashes the diff of every dirty checkout
    return (
        f"warning: shipping uncommitted changes of {snapshot.root} on top of commit {snapshot.commit[:12]}: "
        f"{_listed(list(snapshot.dirty_files))} (diff sha256 {snapshot.diff_sha256[:12]}, recorded in the run's "
        "config.yaml; --require-clean refuses instead)"
    )
