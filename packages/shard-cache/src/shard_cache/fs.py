"""Filesystem helpers over fsspec: open any URL, and write files atomically with each filesystem's own means."""

from __future__ import annotations

import os
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

TMP_PREFIX = ".tmp-"


def get_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return the filesystem of `url` and the path inside it."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when `fs` is the local disk (atomic rename is available)."""
    return isinstance(fs, LocalFileSystem)


def is_process_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when other processes cannot see what this process writes (fsspec's memory://)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "memory" in protocols


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', the separator of every fsspec filesystem."""
    return "/".join([base.rstrip("/"), *parts])


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.

    On local disk: a temporary file in the same directory, fsync, then rename. Object stores and memory://
    replace an object in one put, which is already atomic.
    """
    parent = path.rsplit("/", 1)[0]
    if is_local(fs):
        os.makedirs(parent, exist_ok=True)
        tmp = join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.rsplit('/', 1)[1]}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(path, data)


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """Read a whole file."""
    return fs.cat_file(path)


def remove_leftover_tmp_files(fs: fsspec.AbstractFileSystem, root: str) -> int:
    """Delete temporary files a killed writer left under `root`; returns how many."""
    if not fs.exists(root):
        return 0
    removed = 0
    for path in fs.find(root):
        if path.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
            fs.rm_file(path)
            removed += 1
    return removed
