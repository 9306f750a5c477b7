"""An output directory that appears complete or not at all: written in a temporary place, then moved in."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import fsspec

from .errors import HfBridgeError
from .sources import is_url


class OutputDir:
    """A fresh temporary directory that becomes `path` on success (moved locally, uploaded for URLs)."""

    def __init__(self, path: str | os.PathLike, overwrite: bool) -> None:
        self.text = os.fspath(path)
        self.overwrite = overwrite
        self.remote = is_url(self.text)
        if not self.remote:
            self.target = Path(self.text.removeprefix("file://")).expanduser().absolute()
            self._check_target(self.target.exists() and any(self.target.iterdir()) if self.target.is_dir()
                               else self.target.exists())  # fmt: skip
        else:
            self.fs, self.root = fsspec.core.url_to_fs(self.text)
            self._check_target(self.fs.exists(self.root) and bool(self.fs.ls(self.root)))

    def _check_target(self, occupied: bool) -> None:
        if occupied and not self.overwrite:
            raise HfBridgeError(
                f"{self.text} already exists and is not empty; pass overwrite=True to replace it, or choose a new "
                "directory."
            )

    def __enter__(self) -> Path:
        parent = None if self.remote else self.target.parent
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        # Next to the target, so that the final rename stays on one filesystem.
        self.tmp = Path(tempfile.mkdtemp(prefix=".hf_bridge_tmp_", dir=parent))
        return self.tmp

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        try:
            if exc_type is None:
                self._commit()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _commit(self) -> None:
        if self.remote:
            self._upload()
            return
        old = None
        if self.target.exists():
            old = self.target.with_name(f".{self.target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            self.target.rename(old)
        self.tmp.rename(self.target)
        if old is None:
            return
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()

    def _upload(self) -> None:
        # Object stores cannot rename a directory atomically: upload config.json last, so that a checkpoint
        # whose upload broke off is not taken for a complete one, then remove files of an older export.
        files = sorted(self.tmp.iterdir(), key=lambda p: p.name == "config.json")
        stale = set()
        if self.fs.exists(self.root):
            stale = {entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.root, detail=False)}
        self.fs.makedirs(self.root, exist_ok=True)
        for file in files:
            self.fs.put_file(str(file), f"{self.root.rstrip('/')}/{file.name}")
        for name in stale - {f.name for f in files}:
            self.fs.rm(f"{self.root.rstrip('/')}/{name}", recursive=True)
