"""Whole-file reads and writes that readers never see half done: a temporary name then a rename on local disk,
one put in an object store (an object appears whole or not at all); exclusive creates; umask-respecting modes."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, cast

from storage_io.errors import ErrorFactory, is_storage_failure, storage_error
from storage_io.locations import is_local, is_process_local, join
from storage_io.retries import with_retries

if TYPE_CHECKING:
    import fsspec

TMP_PREFIX = ".tmp-"


def current_umask() -> int:
    """This process's umask, read from /proc where it can be (setting it to read it back is not thread-safe)."""
    with contextlib.suppress(OSError, ValueError):
        match = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.MULTILINE)
        if match:
            return int(match.group(1), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(directory: bool = False) -> int:
    """The mode that the umask gives a new file (or directory), as open() and mkdir() would make it."""
    return (0o777 if directory else 0o666) & ~current_umask()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or creation inside the directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def write_temporary(parent: str, suffix: str, data: bytes) -> str:
    """Write `data`, fsynced, to a new temporary file in `parent` (made if missing); return its path.

    The file gets the umask's mode (0666 & ~umask), as a plain open() would, not mkstemp's 0600.
    """
    os.makedirs(parent, exist_ok=True)
    tmp = join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}{suffix}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o666)
    except FileNotFoundError:
        # Another process may remove an empty directory (a released lock's) between our makedirs and our open:
        # make it again rather than fail.
        os.makedirs(parent, exist_ok=True)
        fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def write_local_atomic(path: str, data: bytes) -> None:
    """Replace the local file `path` with `data` atomically and durably; OSError on failure (nothing left over)."""
    parent, name = os.path.split(os.path.abspath(path))
    # `.tmp-<random>.<name>.tmp`: hidden, found by its prefix after a crash, and named after what it replaces.
    tmp = write_temporary(parent, f".{name}.tmp", data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_dir(parent)


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, error: ErrorFactory = storage_error) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.

    Object stores and memory:// replace an object in one put, which is already atomic (a multi-part upload, too,
    appears only when it completes); transient failures are retried. Failures raise `error(cause, path, "write")`.
    """
    try:
        if is_local(fs):
            write_local_atomic(path, data)
        else:  # no makedirs: object stores have no directories (and s3fs/gcsfs would create a missing bucket)
            with_retries(lambda: fs.pipe_file(path, data))
    except Exception as exc:
        if not is_storage_failure(exc):
            raise
        raise error(exc, path, "write") from exc


def create_exclusive(
    fs: fsspec.AbstractFileSystem, path: str, data: bytes, *, error: ErrorFactory = storage_error
) -> None:
    """Create `path` holding `data`, or raise FileExistsError if it exists: of racing creators one wins.

    Local disk: a hard link of a complete temporary file (so nobody sees the file half-written). S3: a put with
    `If-None-Match: *`. GCS: a put with `ifGenerationMatch=0`. Stores that ignore the precondition (some
    emulators) fall back to last-writer-wins; callers read the file back to see who won.
    """
    parent = path.rsplit("/", 1)[0]
    try:
        if is_local(fs):
            tmp = write_temporary(parent, "", data)
            try:
                os.link(tmp, path)  # atomic; EEXIST when it exists. The directory holds tmp, so it cannot vanish.
            finally:
                _remove_quietly(tmp)
        elif is_process_local(fs):
            if fs.exists(path):
                raise FileExistsError(path)
            fs.pipe_file(path, data)
        else:
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        raise
    except Exception as exc:
        if "precondition" in str(exc).lower():  # S3's 412 when s3fs does not map it to FileExistsError
            raise FileExistsError(path) from exc
        if not is_storage_failure(exc):
            raise
        raise error(exc, path, "write") from exc


def read_bytes(fs: fsspec.AbstractFileSystem, path: str, *, error: ErrorFactory = storage_error) -> bytes:
    """Read a whole file; FileNotFoundError passes through, other failures raise `error(cause, path, "read")`."""
    try:
        # cat_file reads in binary mode; pyright infers str | bytes from fsspec's untyped open().
        return cast(bytes, with_retries(lambda: fs.cat_file(path)))
    except FileNotFoundError:
        raise
    except Exception as exc:
        if not is_storage_failure(exc):
            raise
        raise error(exc, path, "read") from exc


def list_names(fs: fsspec.AbstractFileSystem, directory: str, *, error: ErrorFactory = storage_error) -> list[str]:
    """Names of the files directly in `directory`, freshly listed (empty if it does not exist)."""
    try:
        if is_local(fs):
            return sorted(os.listdir(directory))
        fs.invalidate_cache(directory)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in with_retries(lambda: fs.ls(directory, detail=False)))
    except FileNotFoundError:
        return []
    except Exception as exc:
        if not is_storage_failure(exc):
            raise
        raise error(exc, directory, "list") from exc


def remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete a file; a file already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def remove_leftover_tmp_files(fs: fsspec.AbstractFileSystem, root: str) -> int:
    """Delete temporary files that a killed writer left under `root`; returns how many."""
    if not fs.exists(root):
        return 0
    removed = 0
    for path in fs.find(root):
        if path.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
            remove(fs, path)
            removed += 1
    return removed
