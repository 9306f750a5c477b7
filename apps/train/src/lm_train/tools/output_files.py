"""The folder of a file that a command writes (a plot, a page, a JSON of scores): checked up front, then made."""

from __future__ import annotations

import os
from pathlib import Path

from lm_train.errors import UserError


def check_output_file(out: Path, flag: str) -> None:
    """A UserError naming `flag` when `out` cannot be written (a folder, or under a file); creates nothing."""
    if out.is_dir():
        raise UserError(f"{flag} {out}: that is a folder; give the path of a file in it, e.g. {out / 'out'}.")
    # The first part of the path that exists must be a folder that this user may write in.
    for parent in [out.parent, *out.parent.parents]:
        if not (parent.exists() or parent.is_symlink()):
            continue
        if not parent.is_dir():
            raise UserError(
                f"{flag} {out}: {parent} is a file, not a folder, so nothing can be written under it. Give another "
                "path, or move that file away."
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UserError(
                f"{flag} {out}: this user may not write in {parent}. Give a path where it may, or change that "
                "folder's permissions."
            )
        return


def make_output_folder(out: Path, flag: str) -> None:
    """Make the folder that `out` goes in, or a UserError naming `flag` that says why it cannot be made."""
    check_output_file(out, flag)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {out}: its folder {out.parent} cannot be made ({e.strerror or e}).") from None
