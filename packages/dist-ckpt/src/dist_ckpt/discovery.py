"""Finding checkpoints under a root (a directory or a bucket prefix): complete ones by step, torn and corrupt
ones named loudly and skipped."""

import json
import os
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from dist_ckpt.errors import CheckpointNotFoundError
from dist_ckpt.layout import COMMIT_MARKER, CORRUPT_MARKER
from dist_ckpt.location import Location
from dist_ckpt.objects import list_keys, read_bytes, read_many

_STEP_DIR = re.compile(r"^step-(\d+)$")


class TornCheckpointWarning(UserWarning):
    """A checkpoint directory without its commit marker (or marked corrupt) was found and skipped."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory under a root: its step, whether it is complete, its retention, and whether it
    was marked corrupt. `path` is a pathlib.Path for a local root, the URL for a bucket."""

    path: Path | str
    step: int
    committed: bool
    temporary: bool
    corrupt: bool = False


def _commit_flags(data: bytes | None) -> tuple[bool, bool, bool]:
    """(committed, temporary, corrupt) from a commit marker's bytes; an unreadable marker counts as corrupt."""
    if data is None:
        return False, False, False
    try:
        return True, bool(json.loads(data).get("temporary", False)), False
    except (ValueError, AttributeError):
        return False, False, True


def _local(root: Location) -> list[CheckpointInfo]:
    base = Path(root.path)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        match = _STEP_DIR.match(child.name)
        if match is None or not child.is_dir():
            continue
        location = root.child(child.name)
        committed, temporary, corrupt = _commit_flags(read_bytes(location, COMMIT_MARKER))
        corrupt = corrupt or (child / CORRUPT_MARKER).exists()
        found.append(CheckpointInfo(child, int(match.group(1)), committed and not corrupt, temporary, corrupt))
    return found


def _remote_infos(root: Location) -> list[CheckpointInfo]:
    by_dir: dict[str, set[str]] = defaultdict(set)
    for key in list_keys(root):  # one listing of the prefix (every object under it)
        head, _, rest = key.partition("/")
        if rest and _STEP_DIR.match(head):
            by_dir[head].add(rest)
    markers = read_many(root, [f"{name}/{COMMIT_MARKER}" for name, keys in by_dir.items() if COMMIT_MARKER in keys])
    found = []
    for name, keys in by_dir.items():
        committed, temporary, corrupt = _commit_flags(markers.get(f"{name}/{COMMIT_MARKER}"))
        corrupt = corrupt or CORRUPT_MARKER in keys
        step = int(name.removeprefix("step-"))  # by_dir holds only names that _STEP_DIR matched
        found.append(CheckpointInfo(str(root.child(name)), step, committed and not corrupt, temporary, corrupt))
    return found


def list_checkpoints(root: str | os.PathLike | Location) -> list[CheckpointInfo]:
    """Every `step-N` directory under `root` (a path or an s3:// / gs:// URL), complete or not, sorted by step."""
    location = Location.parse(root)
    found = _local(location) if location.is_local else _remote_infos(location)
    return sorted(found, key=lambda info: info.step)


def latest(root: str | os.PathLike | Location, *, required: bool = False) -> Path | str | None:
    """The newest complete checkpoint under `root`, skipping torn and corrupt-marked ones with a warning that
    names each. A quarantined one (`step-N.corrupt`) is not a checkpoint directory at all.

    With `required=True` (the user asked to resume), finding none is an error instead of None.
    """
    checkpoints = list_checkpoints(root)
    complete = [info for info in checkpoints if info.committed]
    newest_complete_step = complete[-1].step if complete else -1
    skipped = [info for info in checkpoints if not info.committed and info.step > newest_complete_step]
    for info in skipped:
        if info.corrupt:
            why = f"it was marked corrupt ({CORRUPT_MARKER}, or an unreadable {COMMIT_MARKER}), so it is never loaded"
        else:
            why = f"it has no commit marker ({COMMIT_MARKER}), so its save never finished (killed or failed)"
        warnings.warn(
            f"Skipping torn checkpoint {info.path}: {why}. It is never loaded; delete it once you no longer need "
            "to inspect it.",
            TornCheckpointWarning,
            stacklevel=2,
        )
    if complete:
        return complete[-1].path
    if required:
        note = f" Torn or corrupt checkpoints found and skipped: {[str(i.path) for i in skipped]}." if skipped else ""
        raise CheckpointNotFoundError(
            f"Asked to resume, but there is no complete checkpoint under {Location.parse(root)}.{note} Check the "
            "checkpoint root in your config, or start without resuming to train from step 0."
        )
    return None


def resolve_checkpoint(url: str | os.PathLike) -> Path | str | None:
    """The checkpoint to load for `url`: `url` itself if it is a committed checkpoint, else the newest committed
    one directly under it, else None. Torn and corrupt-marked ones are never returned.

    Use it for a user's "checkpoint or folder of checkpoints" setting: the manifest alone does not make a
    checkpoint (it is written before the commit marker).
    """
    location = Location.parse(url)
    committed, _, corrupt = _commit_flags(read_bytes(location, COMMIT_MARKER))
    if committed and read_bytes(location, CORRUPT_MARKER) is None and not corrupt:
        return location.public()
    return latest(location)
