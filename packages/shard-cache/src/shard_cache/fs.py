"""shard-cache's storage edge: storage_io's locations and atomic writes, with errors that are ShardCacheErrors
worded for a cache (the file, the cause, and the fix; a build resumes after one)."""

from __future__ import annotations

import functools

import fsspec

import storage_io
from shard_cache.errors import ShardCacheError, StorageError
from storage_io import (
    STORAGE_ENV_KEYS,
    TMP_PREFIX,
    apply_storage_env,
    is_local,
    is_process_local,
    join,
    protocol_of,
    remove,
    remove_leftover_tmp_files,
    storage_env,
)

__all__ = [
    "STORAGE_ENV_KEYS",
    "TMP_PREFIX",
    "apply_storage_env",
    "create_exclusive",
    "get_fs",
    "is_local",
    "is_process_local",
    "join",
    "list_names",
    "protocol_of",
    "read_bytes",
    "remove",
    "remove_leftover_tmp_files",
    "storage_env",
    "storage_error",
    "write_atomic",
]
# The extra of this package that installs each object store's backend.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def get_fs(url: str, *, listings_cache: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return the filesystem of `url` and the path inside it (listings uncached unless `listings_cache`)."""
    try:
        return storage_io.open_fs(url, listings_cache=listings_cache)
    except storage_io.LocationError as exc:
        extra = _EXTRAS.get(exc.protocol)
        if extra is None:
            raise ShardCacheError(str(exc)) from exc
        cause = exc.__cause__ or exc
        raise ShardCacheError(
            f"{url}: the {exc.protocol}:// filesystem needs a package that is not installed ({cause}). "
            f"Run: pip install 'shard-cache[{extra}]'."
        ) from exc
    except storage_io.StorageError as exc:
        raise StorageError(str(exc), location=exc.location, reason=exc.reason) from exc


def storage_error(exc: BaseException, path: str, writing: bool, verb: str = "") -> StorageError:
    """A one-paragraph error for a failure on `path`, with the fix for its cause."""
    if isinstance(exc, StorageError):
        return exc
    reason = storage_io.classify(exc)
    verb = verb or ("write" if writing else "read")
    if reason == "full":
        message = (
            f"{path}: cannot write it: no space left on the device. Free space (or give a directory with room), "
            "then run the same command again: nothing written before is lost, and a build resumes."
        )
    elif reason == "denied":
        message = (
            f"{path}: cannot {verb} it: permission denied. Make it {'writable' if writing else 'readable'} for this "
            "user (chmod/chown), or check the credentials of the bucket."
        )
    elif reason == "not_found":
        message = f"{path}: cannot {verb} it: no such file. Check the path or URL."
    elif reason == "other":
        message = (
            f"{path}: cannot {verb} it ({type(exc).__name__}: {exc}). Check the path, the network and the credentials."
        )
    else:
        message = (
            f"{path}: cannot {verb} it ({type(exc).__name__}: {storage_io.detail_of(exc)}): {storage_io.FIXES[reason]}."
        )
    return StorageError(message, location=path, reason=reason)


def _error(exc: BaseException, path: str, doing: str) -> StorageError:
    return storage_error(exc, path, writing=doing == "write", verb=doing)


write_atomic = functools.partial(storage_io.write_atomic, error=_error)
write_atomic.__doc__ = "Write `data` to `path` so that readers see the old file or the whole new one, never a part."
create_exclusive = functools.partial(storage_io.create_exclusive, error=_error)
create_exclusive.__doc__ = "Create `path` holding `data`, or raise FileExistsError if it exists."
read_bytes = functools.partial(storage_io.read_bytes, error=_error)
read_bytes.__doc__ = "Read a whole file; FileNotFoundError passes through, other failures become a StorageError."
list_names = functools.partial(storage_io.list_names, error=_error)
list_names.__doc__ = "Names of the files directly in `directory`, freshly listed (empty if it does not exist)."
