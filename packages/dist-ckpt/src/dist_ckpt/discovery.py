"""Finding checkpoints under a root: complete ones by step, torn ones named loudly."""

import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from dist_ckpt.errors import CheckpointNotFoundError
from dist_ckpt.layout import COMMIT_MARKER, is_committed, read_commit

_STEP_DIR = re.compile(r"^step-(\d+)$")


class TornCheckpointWarning(UserWarning):
    """A checkpoint directory without its commit marker was found and skipped."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory under a root: its step, whether it is complete, and its retention."""

    path: Path
    step: int
    committed: bool
    temporary: bool


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """Every `step-N` directory under `root`, complete or torn, sorted by step."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match is None or not child.is_dir():
            continue
        committed = is_committed(child)
        temporary = bool(read_commit(child).get("temporary", False)) if committed else False
        found.append(CheckpointInfo(child, int(match.group(1)), committed, temporary))
    return sorted(found, key=lambda info: info.step)


def latest(root: str | os.PathLike, *, required: bool = False) -> Path | None:
    """The newest complete checkpoint under `root`, skipping torn ones with a warning that names each.

    With `required=True` (the user asked to resume), finding none is an error instead of None.
    """
    checkpoints = list_checkpoints(root)
    complete = [info for info in checkpoints if info.committed]
    newest_complete_step = complete[-1].step if complete else -1
    torn = [info for info in checkpoints if not info.committed and info.step > newest_complete_step]
    for info in torn:
        warnings.warn(
            f"Skipping torn checkpoint {info.path}: it has no commit marker ({COMMIT_MARKER}), so its save "
            "never finished (killed or failed). It is never loaded; delete it once you no longer need to "
            "inspect it.",
            TornCheckpointWarning,
            stacklevel=2,
        )
    if complete:
        return complete[-1].path
    if required:
        torn_note = f" Torn (incomplete) checkpoints found and skipped: {[str(i.path) for i in torn]}." if torn else ""
        raise CheckpointNotFoundError(
            f"Asked to resume, but there is no complete checkpoint under {Path(root)}.{torn_note} Check the "
            "checkpoint root in your config, or start without resuming to train from step 0."
        )
    return None
