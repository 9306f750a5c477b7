"""On-disk layout of a checkpoint directory: manifest, per-process done files, the commit marker."""

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dist_ckpt.errors import CheckpointError, CheckpointNotFoundError

FORMAT_NAME = "dist-ckpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
ARRAYS_DIR = "arrays"
OCDBT_DIR = "arrays.ocdbt"
DONE_DIR = ".done"


def step_dir_name(step: int) -> str:
    """Name of the directory of the checkpoint of `step` under a checkpoints root."""
    return f"step-{step}"


def write_json_atomically(path: Path, content: Any) -> None:
    """Write JSON to `path` so that readers see either nothing or the whole file, durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the checkpoint from other readers
        with os.fdopen(fd, "w") as file:
            json.dump(content, file, indent=1, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_committed(path: Path) -> bool:
    """True when `path` holds a complete checkpoint (its commit marker exists)."""
    return (path / COMMIT_MARKER).is_file()


def read_commit(path: Path) -> dict[str, Any]:
    """The commit marker's content (step, retention, time) of a complete checkpoint."""
    return json.loads((path / COMMIT_MARKER).read_text())


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the complete checkpoint at `path`: step, time, metadata and one entry per leaf."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"No checkpoint directory at {path}. Pass the path of a step directory (e.g. .../step-100), "
            "or find the newest one with dist_ckpt.latest(root)."
        )
    if not is_committed(path):
        raise CheckpointError(
            f"Checkpoint {path} has no commit marker ({COMMIT_MARKER}): its save never finished (the process "
            "was killed or the write failed), so its contents may be partial and it is never loaded. Load "
            "an earlier checkpoint (dist_ckpt.latest(root) skips torn ones) and delete this directory."
        )
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT_NAME or manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path / MANIFEST} is not a dist-ckpt manifest of a version this release reads "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}; this release reads "
            f"{FORMAT_NAME!r} up to version {FORMAT_VERSION}). Upgrade dist-ckpt to load it."
        )
    return manifest


def delete_checkpoint(path: Path) -> None:
    """Delete a checkpoint directory, removing the commit marker first so that a crash mid-delete is torn."""
    (path / COMMIT_MARKER).unlink(missing_ok=True)
    if path.exists():
        fsync_dir(path)
        shutil.rmtree(path)
