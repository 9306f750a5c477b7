"""Storage at the package's edge: any path or fsspec URL (local, gs://, s3://, memory://), with atomic writes,
exclusive creates, and errors that name the file and the fix.

Credentials and endpoints come only from each ecosystem's standard settings: `AWS_*` for s3 (s3fs, through
botocore, reads `AWS_ENDPOINT_URL`, the keys and the region), Application Default Credentials and
`STORAGE_EMULATOR_HOST` for gcs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from shard_cache.errors import ShardCacheError, StorageError

TMP_PREFIX = ".tmp-"
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# What Ray workers of a build need to reach the same stores as the driver, when the cluster started them
# with another environment. Paths to credential files are not forwarded: they belong to the driver's host.
STORAGE_ENV_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
)


def _prepare_gcs() -> None:
    # gcsfs >= 2026 first asks a bucket for its type over gRPC. An emulator speaks only the JSON API: the probe
    # fails on every call and logs a warning each time (or, where ADC exist, reaches for the real service). With
    # an emulator configured we turn the probe off, unless the user set the switch. gcsfs reads it at import.
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def protocol_of(url: str) -> str:
    """The URL's scheme ('file' for plain paths)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def get_fs(url: str, *, listings_cache: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return the filesystem of `url` and the path inside it.

    Listings are not cached by default: a cache directory is written by other processes, and a stale listing
    would hide their files.
    """
    protocol = protocol_of(url)
    if protocol in ("gs", "gcs"):
        _prepare_gcs()
    options: dict[str, Any] = {} if listings_cache or protocol == "file" else {"use_listings_cache": False}
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        fix = f"pip install 'shard-cache[{extra}]'" if extra else "install the fsspec filesystem for it"
        raise ShardCacheError(
            f"{url}: the {protocol}:// filesystem needs a package that is not installed ({exc}). Run: {fix}."
        ) from exc
    except ValueError as exc:
        raise ShardCacheError(f"{url}: not a path or a known fsspec URL ({exc}). Check the spelling.") from exc


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when `fs` is the local disk (atomic rename and hard links are available)."""
    return isinstance(fs, LocalFileSystem)


def is_process_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when other processes cannot see what this process writes (fsspec's memory://)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "memory" in protocols


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', the separator of every fsspec filesystem."""
    return "/".join([base.rstrip("/"), *parts])


def storage_error(exc: BaseException, path: str, writing: bool, verb: str = "") -> ShardCacheError:
    """A one-paragraph error for an OSError on `path`, with the fix for its cause."""
    code = getattr(exc, "errno", None)
    verb = verb or ("write" if writing else "read")
    if isinstance(exc, FileNotFoundError):
        return StorageError(f"{path}: cannot {verb} it: no such file. Check the path or URL.")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(
            f"{path}: cannot write it: no space left on the device. Free space (or give a directory with room), "
            "then run the same command again: nothing written before is lost, and a build resumes."
        )
    if isinstance(exc, PermissionError) or code in (errno.EACCES, errno.EPERM):
        return StorageError(
            f"{path}: cannot {verb} it: permission denied. Make it {'writable' if writing else 'readable'} for this "
            "user (chmod/chown), or check the credentials of the bucket."
        )
    if code == errno.EROFS:
        return StorageError(f"{path}: cannot write it: the file system is read-only. Use a writable location.")
    return StorageError(
        f"{path}: cannot {verb} it ({type(exc).__name__}: {exc}). Check the path, the network and the credentials."
    )


def write_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.

    On local disk: a temporary file in the same directory, fsync, then rename (the temporary file is removed if
    the write fails, e.g. on a full disk). Object stores and memory:// replace an object in one put, which is
    already atomic (a multi-part upload, too, appears only when it completes).
    """
    parent = path.rsplit("/", 1)[0]
    try:
        if is_local(fs):
            tmp = _write_local_temporary(parent, f"-{path.rsplit('/', 1)[1]}", data)
            try:
                os.replace(tmp, path)
            except BaseException:
                _remove_quietly(tmp)
                raise
        else:  # no makedirs: object stores have no directories (and s3fs/gcsfs would create a missing bucket)
            fs.pipe_file(path, data)
    except OSError as exc:
        raise storage_error(exc, path, writing=True) from exc


def _write_local_temporary(parent: str, suffix: str, data: bytes) -> str:
    """Write `data`, fsynced, to a new temporary file in `parent` (made if missing); return its path."""
    os.makedirs(parent, exist_ok=True)
    tmp = join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}{suffix}")
    try:
        f = open(tmp, "wb")  # noqa: SIM115 (the with below closes it)
    except FileNotFoundError:
        # A builder releasing its lock removes the empty `.locks`; that can land between our makedirs and our
        # open, so make the directory again rather than fail.
        os.makedirs(parent, exist_ok=True)
        f = open(tmp, "wb")  # noqa: SIM115
    try:
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    return tmp


def _link_new_local_file(parent: str, path: str, data: bytes) -> None:
    """Hard-link a complete temporary file to `path`; EEXIST when it exists."""
    tmp = _write_local_temporary(parent, "", data)
    try:
        os.link(tmp, path)  # atomic; fails with EEXIST. The directory holds tmp, so it cannot vanish now.
    finally:
        _remove_quietly(tmp)


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Create `path` holding `data`, or raise FileExistsError if it exists: of racing creators one wins.

    Local disk: a hard link of a complete temporary file (so nobody sees the file half-written). S3: a put with
    `If-None-Match: *`. GCS: a put with `ifGenerationMatch=0`. Stores that ignore the precondition (some
    emulators) fall back to last-writer-wins; callers read the file back to see who won.
    """
    parent = path.rsplit("/", 1)[0]
    try:
        if is_local(fs):
            _link_new_local_file(parent, path, data)
        elif is_process_local(fs):
            if fs.exists(path):
                raise FileExistsError(path)
            fs.pipe_file(path, data)
        else:
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        raise
    except OSError as exc:
        if "precondition" in str(exc).lower():  # S3's 412 when s3fs does not map it to FileExistsError
            raise FileExistsError(path) from exc
        raise storage_error(exc, path, writing=True) from exc


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """Read a whole file; FileNotFoundError passes through, other failures become a StorageError."""
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise
    except IsADirectoryError as exc:
        raise StorageError(f"{path}: a directory where a file was expected. Check the path.") from exc
    except OSError as exc:
        raise storage_error(exc, path, writing=False) from exc


def list_names(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    """Names of the files directly in `directory`, freshly listed (empty if it does not exist)."""
    try:
        if is_local(fs):
            return sorted(os.listdir(directory))
        fs.invalidate_cache(directory)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise storage_error(exc, directory, writing=False) from exc


def remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Delete a file; a file already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def remove_leftover_tmp_files(fs: fsspec.AbstractFileSystem, root: str) -> int:
    """Delete temporary files a killed writer left under `root`; returns how many."""
    if not fs.exists(root):
        return 0
    removed = 0
    for path in fs.find(root):
        if path.rsplit("/", 1)[-1].startswith(TMP_PREFIX):
            remove(fs, path)
            removed += 1
    return removed


def storage_env() -> dict[str, str]:
    """The standard storage settings of this process that are set (for Ray workers of a build)."""
    return {key: os.environ[key] for key in STORAGE_ENV_KEYS if key in os.environ}


def apply_storage_env(env: dict[str, str]) -> None:
    """Adopt the driver's storage settings in a worker; cached filesystems made under other settings are dropped."""
    changed = False
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
            changed = True
    if changed:
        for protocol in ("s3", "gs"):
            cls = fsspec.registry.get(protocol)
            if cls is not None:
                cls.clear_instance_cache()
