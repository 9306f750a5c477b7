"""The small objects of a checkpoint (manifest, markers, done files) and whole-directory operations, on local
disk or in a bucket; every failure becomes a StorageError that names the file or URL and the fix."""

import errno
import functools
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tensorstore as ts

from dist_ckpt.errors import StorageError
from dist_ckpt.location import Location
from dist_ckpt.retries import RetryPolicy, retry_policy

# Bounded concurrency of deletes and copies in a bucket (each a request; copies hold one object in memory).
_WINDOW = 16
_STATUS = re.compile(r"^([A-Z_]+): ")
_UNREACHABLE = {"ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}


def tensorstore_status(error: BaseException) -> str:
    """The canonical status code at the start of a tensorstore error message ("" when there is none)."""
    match = _STATUS.match(str(error))
    return match.group(1) if match else ""


def storage_error(error: BaseException, url: str, doing: str) -> StorageError:
    """A StorageError for a failed `doing` (e.g. "write") of `url`, with the fix for its kind of failure."""
    detail = str(error)
    status = tensorstore_status(error)
    code = getattr(error, "errno", None)
    if status in ("PERMISSION_DENIED", "UNAUTHENTICATED") or code in (errno.EACCES, errno.EPERM):
        reason, fix = (
            "denied",
            (
                "access was denied. Give this process access to it: fix the file's permissions (ls -l), or the "
                "credentials of the bucket (the AWS_* variables for s3, Application Default Credentials for gs)"
            ),
        )
    elif code in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in detail or "quota" in detail.lower():
        reason, fix = (
            "full",
            (
                "the disk is full. Free space there, keep fewer checkpoints (the Checkpointer's keep and "
                "save_interval), or save under a root with more room"
            ),
        )
    elif status in _UNREACHABLE or "CURL error" in detail or "Could not connect" in detail:
        reason, fix = (
            "unreachable",
            (
                f"the storage did not answer ({retry_policy().describe()} of retries with exponential backoff). "
                "Check that the server is up and reachable (AWS_ENDPOINT_URL or STORAGE_EMULATOR_HOST, the "
                "network), then run again"
            ),
        )
    elif "NoSuchBucket" in detail or (status == "NOT_FOUND" and "bucket" in detail.lower()):
        reason, fix = "no_bucket", "the bucket does not exist. Create it, or fix the bucket name in the checkpoint URL"
    else:
        reason, fix = "other", "see the cause above"
    return StorageError(f"Could not {doing} {url}: {detail}. {fix[0].upper()}{fix[1:]}.", url=url, reason=reason)


@functools.lru_cache(maxsize=8)
def _context(policy: RetryPolicy) -> ts.Context:
    return ts.Context(policy.context_spec())


def shared_context() -> ts.Context:
    """The tensorstore context of metadata requests: the retry policy in force."""
    return _context(retry_policy())


@functools.lru_cache(maxsize=64)
def _open(spec_json: str, policy: RetryPolicy) -> ts.KvStore:
    return ts.KvStore.open(json.loads(spec_json), context=_context(policy)).result()


def _kvstore(location: Location) -> ts.KvStore:
    """The kvstore of a bucket directory (its spec follows the environment at call time)."""
    spec = location.kvstore_spec()
    try:
        return _open(json.dumps(spec, sort_keys=True), retry_policy())
    except ValueError as error:
        raise storage_error(error, str(location), "open") from None


def _remote(result: Any, url: str, doing: str) -> Any:
    try:
        return result.result()
    except ValueError as error:
        raise storage_error(error, url, doing) from None


def read_bytes(location: Location, key: str) -> bytes | None:
    """The content of `key` below `location`, or None when it does not exist."""
    url = location.url_of(key)
    if location.is_local:
        try:
            return Path(url).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as error:
            raise storage_error(error, url, "read") from None
    result = _remote(_kvstore(location).read(key), url, "read")
    return result.value if result.state == "value" else None


def read_many(location: Location, keys: list[str]) -> dict[str, bytes | None]:
    """The content of each of `keys` below `location` (None when missing), read concurrently in a bucket."""
    if location.is_local or not keys:
        return {key: read_bytes(location, key) for key in keys}
    store = _kvstore(location)
    results: dict[str, bytes | None] = {}
    for start in range(0, len(keys), _WINDOW * 4):
        futures = [(key, store.read(key)) for key in keys[start : start + _WINDOW * 4]]
        for key, future in futures:
            result = _remote(future, location.url_of(key), "read")
            results[key] = result.value if result.state == "value" else None
    return results


def exists(location: Location, key: str) -> bool:
    """Whether the file or object `key` exists below `location`."""
    if location.is_local:
        return Path(location.url_of(key)).is_file()
    return read_bytes(location, key) is not None


def current_umask() -> int:
    """This process's umask, read from /proc where it can be (setting it to read it back is not thread-safe)."""
    try:
        match = re.search(r"^Umask:\s*([0-7]+)", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        match = None
    if match:
        return int(match.group(1), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bytes(location: Location, key: str, data: bytes) -> None:
    """Write `key` so that readers see either nothing or all of it, durably (one PUT in a bucket)."""
    url = location.url_of(key)
    if not location.is_local:
        _remote(_kvstore(location).write(key, data), url, "write")
        return
    path = Path(url)
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would hide the checkpoint from the group
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
        fsync_dir(path.parent)
    except OSError as error:
        raise storage_error(error, url, "write") from None
    finally:
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)


def write_json(location: Location, key: str, content: Any) -> None:
    """Write `content` as JSON to `key` (see write_bytes)."""
    write_bytes(location, key, json.dumps(content, indent=1, sort_keys=True).encode())


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside the directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_keys(location: Location) -> list[str]:
    """Every file or object below `location`, as keys relative to it ("/"-separated), sorted."""
    if location.is_local:
        root = Path(location.path)
        if not root.is_dir():
            return []
        try:
            return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())
        except OSError as error:
            raise storage_error(error, str(location), "list") from None
    # The listing is of the directory's own kvstore, so the prefix goes to the server as such (GCS emulators
    # ignore the start/end offsets of a key range).
    keys = _remote(_kvstore(location).list(), str(location), "list")
    return sorted(key.decode() for key in keys)


def delete(location: Location, key: str) -> None:
    """Delete `key` below `location` (nothing happens if it is missing)."""
    url = location.url_of(key)
    if location.is_local:
        try:
            Path(url).unlink(missing_ok=True)
            fsync_dir(Path(url).parent)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise storage_error(error, url, "delete") from None
        return
    _remote(_kvstore(location).write(key, None), url, "delete")


def delete_tree(location: Location, *, first: Iterable[str] = (), last: Iterable[str] = ()) -> None:
    """Delete everything below `location`: the keys `first` before the rest (so that a crash leaves it torn),
    the keys `last` after it."""
    last = list(last)
    for key in first:
        delete(location, key)
    if location.is_local:
        if Path(location.path).exists():
            try:
                shutil.rmtree(location.path)
            except OSError as error:
                raise storage_error(error, str(location), "delete") from None
        return
    store = _kvstore(location)
    keys = [key for key in list_keys(location) if key not in last]
    for start in range(0, len(keys), _WINDOW):
        futures = [(key, store.write(key, None)) for key in keys[start : start + _WINDOW]]
        for key, future in futures:
            _remote(future, location.url_of(key), "delete")
    for key in last:
        delete(location, key)


def copy_tree(source: Location, target: Location, *, skip: Iterable[str] = ()) -> None:
    """Copy every object below `source` to the same keys below `target` (buckets: there is no rename)."""
    if source.is_local or target.is_local:
        raise ValueError("copy_tree copies between bucket prefixes; rename local directories instead")
    skipped = set(skip)
    keys = [key for key in list_keys(source) if key not in skipped]
    source_store, target_store = _kvstore(source), _kvstore(target)
    for start in range(0, len(keys), _WINDOW):
        window = keys[start : start + _WINDOW]
        reads = [(key, source_store.read(key)) for key in window]
        writes = []
        for key, read in reads:
            result = _remote(read, source.url_of(key), "read")
            if result.state == "value":
                writes.append((key, target_store.write(key, result.value)))
        for key, write in writes:
            _remote(write, target.url_of(key), "write")


def has_any(location: Location) -> bool:
    """Whether anything exists below `location` (a directory, or objects under the prefix)."""
    if location.is_local:
        return Path(location.path).exists()
    return bool(list_keys(location))
