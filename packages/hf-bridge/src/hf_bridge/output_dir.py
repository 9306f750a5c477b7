"""Where an export is written, so that it appears complete or not at all.

Locally: a temporary directory next to the target, renamed into place once the export is written and checked
(with the modes that the umask gives, not mkdtemp's 0700). At a URL (object stores cannot rename): each file
is uploaded under its final name (an upload that breaks off leaves no object), and config.json goes last, so
a prefix without config.json is never taken for a checkpoint; an overwrite removes the old config.json first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import storage_io

from .errors import HfBridgeError
from .reader import CONFIG_FILE
from .sources import Location, is_url, storage_error, storage_errors, strip_file_scheme, url_fs

T = TypeVar("T")
# The upload buffer of a remote file: S3 needs parts of 5 MiB or more, GCS multiples of 256 KiB.
REMOTE_BLOCK = 16 * 2**20


class OutputDir:
    """The destination of one export: `create`, `write_bytes`, then `publish` (or `discard` on failure)."""

    def __init__(self, path: str | os.PathLike, overwrite: bool) -> None:
        self.text = os.fspath(path)
        self.overwrite = overwrite
        self.remote = is_url(self.text)
        self.handles: list[Any] = []
        self.created: list[str] = []
        self.tmp: Path | None = None
        if self.remote:
            self.fs, self.root = url_fs(self.text, "export")
            self.root = self.root.rstrip("/")
            self.before = self._guard(self._remote_names, "")
            self._check_target(bool(self.before))
        else:
            self.target = Path(strip_file_scheme(self.text)).expanduser().absolute()
            occupied = self.target.exists() and (not self.target.is_dir() or any(self.target.iterdir()))
            self._check_target(occupied)

    def _check_target(self, occupied: bool) -> None:
        if occupied and not self.overwrite:
            raise HfBridgeError(
                f"{self.text} already exists and is not empty; pass overwrite=True to replace it, or choose a new "
                "directory."
            )

    def _remote_names(self) -> set[str]:
        if not self.fs.isdir(self.root):
            return set()
        return {e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False)}

    def open(self) -> OutputDir:
        """Make the place files are written to (a temporary directory locally)."""
        if self.remote:
            if CONFIG_FILE in self.before:
                # From now on the old export no longer looks complete, while its files are replaced one by one.
                self._guard(lambda: self.fs.rm_file(self._remote(CONFIG_FILE)), CONFIG_FILE, "Removing")
            return self
        parent = self.target.parent
        self._guard(lambda: parent.mkdir(parents=True, exist_ok=True), "", "Creating")
        # Next to the target, so that the final rename stays on one file system.
        self.tmp = Path(
            self._guard(lambda: tempfile.mkdtemp(prefix=f".{self.target.name}.hf_bridge_tmp_", dir=parent), "")
        )
        return self

    def where(self, name: str) -> str:
        """The final path or URL of a file, for messages."""
        return f"{self.text.rstrip('/')}/{name}" if name else self.text

    def written(self) -> Location:
        """The files as written so far (to read them back)."""
        if self.remote:
            self.fs.invalidate_cache(self.root)  # listings cached before the upload would hide its files
            return Location(self.text, self.fs, self.root)
        return Location(str(self.tmp), None, str(self.tmp))

    def _remote(self, name: str) -> str:
        return f"{self.root}/{name}"

    def create(self, name: str) -> Any:
        """A new file opened for binary writing."""
        if self.remote:
            handle = self._guard(lambda: self.fs.open(self._remote(name), "wb", block_size=REMOTE_BLOCK), name)
        else:
            tmp = self.tmp
            assert tmp is not None  # a local export writes into its temporary directory, made by open()
            handle = self._guard(lambda: open(tmp / name, "wb"), name)  # noqa: SIM115 (closed by the writer)
        self.handles.append(handle)
        self.created.append(name)
        return handle

    def write_bytes(self, name: str, data: bytes) -> None:
        """A whole small file."""
        handle = self.create(name)
        self.guard(lambda: handle.write(data), name)
        self.guard(handle.close, name)

    def guard(self, fn: Callable[[], T], name: str) -> T:
        """fn(), with an OSError turned into a clear error naming the file."""
        return self._guard(fn, name)

    def _guard(self, fn: Callable[[], T], name: str, doing: str = "Writing") -> T:
        try:
            return fn()
        except HfBridgeError:
            raise
        except storage_errors() as e:
            kept = "" if self.remote else " Nothing was published: the destination is as it was."
            raise HfBridgeError(f"{storage_error(e, self.where(name), doing)}{kept}") from None

    def publish(self) -> None:
        """Make the written export the destination (with config.json written last at a URL)."""
        if self.remote:
            for name in sorted(self.before - set(self.created) - {CONFIG_FILE}):
                self._guard(lambda name=name: self.fs.rm(self._remote(name), recursive=True), name, "Removing")
            return
        self._guard(self._publish_local, "", "Publishing")

    def _publish_local(self) -> None:
        assert self.tmp is not None
        for file in self.tmp.iterdir():
            file.chmod(storage_io.file_mode())
        self.tmp.chmod(storage_io.file_mode(directory=True))  # mkdtemp's 0700 would hide the export
        old = None
        if self.target.exists() or self.target.is_symlink():
            old = self.target.with_name(f".{self.target.name}.old")
            _remove(old)
            self.target.rename(old)
        self.tmp.rename(self.target)
        self.tmp = None
        if old is not None:
            _remove(old)

    def discard(self) -> None:
        """Remove what was written of an export that failed (the destination keeps what it had)."""
        for handle in self.handles:
            with contextlib.suppress(Exception):
                if not handle.closed:
                    # fsspec's discard aborts an upload instead of completing it, as close() would.
                    (getattr(handle, "discard", None) or handle.close)()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        elif self.remote:
            for name in self.created:
                with contextlib.suppress(Exception):
                    if name not in self.before:  # never delete a file of an older export
                        self.fs.rm_file(self._remote(name))


def check_export_target(path: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Raise HfBridgeError now if an export to `path` would be refused (not empty without overwrite, or a store
    that cannot be reached); writes nothing. For a program to call before the expensive work that precedes one."""
    OutputDir(path, overwrite)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
