"""Layout of a checkpoint directory: manifest, per-process done files, the commit and corruption markers.

The commit protocol, the same on local disk and in a bucket (where there is no atomic rename): every process
writes its arrays, then its done file; process 0 then writes the manifest, and the commit marker last. A
directory without the marker is torn and never loaded; one with a CORRUPT marker was found damaged and is never
loaded either. Deleting removes the commit marker first, so that a half-deleted checkpoint is torn.
"""

import json
import os
from typing import Any

import crc32c

from dist_ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from dist_ckpt.location import Location
from dist_ckpt.objects import delete_tree, has_any, read_bytes, write_bytes

FORMAT_NAME = "dist-ckpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMIT_MARKER = "COMMITTED"
CORRUPT_MARKER = "CORRUPT"
ARRAYS_DIR = "arrays"
OCDBT_DIR = "arrays.ocdbt"
DONE_DIR = ".done"
QUARANTINE_SUFFIX = ".corrupt"


def step_dir_name(step: int) -> str:
    """Name of the directory of the checkpoint of `step` under a checkpoints root."""
    return f"step-{step}"


def corruption_fix(path: Location) -> str:
    """The fix every corruption message ends with."""
    return (
        f"Resume from an earlier checkpoint instead: dist_ckpt.latest() skips quarantined ones, and "
        f"dist_ckpt.quarantine('{path}') renames this one {path.name}{QUARANTINE_SUFFIX} so that no later run "
        "trusts it; or restore the file from a copy."
    )


def corrupt(path: Location, file: str, what: str, key: str | None = None) -> CorruptCheckpointError:
    """The error for a damaged committed checkpoint: what is wrong with which file, and the fix."""
    leaf = f" (leaf {key})" if key else ""
    return CorruptCheckpointError(
        f"Checkpoint {path} is damaged: {file}{leaf} {what}. {corruption_fix(path)}", path=str(path), file=file, key=key
    )


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest as it is stored (its crc32c goes into the commit marker)."""
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def write_commit(path: Location, commit: dict[str, Any], manifest: bytes) -> None:
    """Write the commit marker, last: it records the manifest's checksum."""
    write_bytes(path, COMMIT_MARKER, json.dumps({**commit, "manifest_crc32c": crc32c.crc32c(manifest)}).encode())


def is_committed(path: Location) -> bool:
    """True when `path` holds a complete checkpoint (its commit marker exists)."""
    return read_bytes(path, COMMIT_MARKER) is not None


def _parse(path: Location, key: str, data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise corrupt(path, path.url_of(key), f"is not valid JSON ({error})") from None


def read_commit(path: Location) -> dict[str, Any] | None:
    """The commit marker's content (step, retention, time, manifest checksum), or None when torn."""
    data = read_bytes(path, COMMIT_MARKER)
    if data is None:
        return None
    commit = _parse(path, COMMIT_MARKER, data)
    if not isinstance(commit, dict):
        raise corrupt(path, path.url_of(COMMIT_MARKER), "does not hold a JSON object")
    return commit


def read_corrupt_marker(path: Location) -> dict[str, Any] | None:
    """Why the checkpoint was marked corrupt (None when it was not); a damaged marker still marks it."""
    data = read_bytes(path, CORRUPT_MARKER)
    if data is None:
        return None
    try:
        return dict(json.loads(data))
    except (ValueError, TypeError):
        return {"reason": "(the CORRUPT marker itself is unreadable)"}


def read_manifest(path: "str | os.PathLike | Location") -> dict[str, Any]:
    """The manifest of the complete checkpoint at `path`: step, time, metadata and one entry per leaf.

    A damaged manifest (not JSON, or not the bytes the commit marker's checksum says) raises
    CorruptCheckpointError; a torn or quarantined checkpoint raises CheckpointError.
    """
    path = Location.parse(path)
    marker = read_corrupt_marker(path)
    if marker is not None:
        raise CorruptCheckpointError(
            f"Checkpoint {path} was marked corrupt ({CORRUPT_MARKER}: {marker.get('reason', '?')}), so it is never "
            f"loaded. Load an earlier checkpoint (dist_ckpt.latest(root) skips it); delete it once you no "
            "longer need to inspect it.",
            path=str(path),
            file=path.url_of(CORRUPT_MARKER),
            key=marker.get("key"),
        )
    commit = read_commit(path)
    if commit is None:
        if not has_any(path):
            raise CheckpointNotFoundError(
                f"No checkpoint directory at {path}. Pass the path of a step directory (e.g. .../step-100), "
                "or find the newest one with dist_ckpt.latest(root)."
            )
        raise CheckpointError(
            f"Checkpoint {path} has no commit marker ({COMMIT_MARKER}): its save never finished (the process "
            "was killed or the write failed), so its contents may be partial and it is never loaded. Load "
            "an earlier checkpoint (dist_ckpt.latest(root) skips torn ones) and delete this directory."
        )
    data = read_bytes(path, MANIFEST)
    if data is None:
        raise corrupt(path, path.url_of(MANIFEST), "is missing although the checkpoint is committed")
    expected = commit.get("manifest_crc32c")  # absent in checkpoints of dist-ckpt 0.1
    if expected is not None and crc32c.crc32c(data) != expected:
        raise corrupt(
            path, path.url_of(MANIFEST), f"does not match the checksum in {COMMIT_MARKER} (altered or truncated)"
        )
    manifest = _parse(path, MANIFEST, data)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise corrupt(path, path.url_of(MANIFEST), "is not a dist-ckpt manifest")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path.url_of(MANIFEST)} is not a dist-ckpt manifest of a version this release reads "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}; this release reads "
            f"{FORMAT_NAME!r} up to version {FORMAT_VERSION}). Upgrade dist-ckpt to load it."
        )
    return manifest


def delete_checkpoint(path: Location) -> None:
    """Delete a checkpoint, removing the commit marker first so that a crash mid-delete leaves it torn."""
    delete_tree(path, first=[COMMIT_MARKER])
