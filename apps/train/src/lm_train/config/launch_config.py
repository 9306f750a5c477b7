"""The `launch` section: what `lm-train launch` records about the code it shipped; training ignores it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchRecord:
    """Written by `lm-train launch` into the run's config.yaml, so that the run says which code trained it."""

    backend: str = ""
    """The launcher that started the run (ray, ...)."""
    commit: str | None = None
    """The git commit of the shipped checkout; null: lm-train was not run from a git checkout."""
    diff_sha256: str | None = None
    """sha256 of the uncommitted changes that were shipped with the commit (diff and untracked files); null: none."""
    dirty_files: tuple[str, ...] = ()
    """The files whose uncommitted state was shipped, as `git status` names them."""
