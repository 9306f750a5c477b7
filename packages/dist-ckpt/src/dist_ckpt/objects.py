"""The small objects of a checkpoint (manifest, markers, done files) and whole-directory operations, on local
disk or in a bucket; every failure becomes a StorageError that names the file or URL and the fix."""

import functools
import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tensorstore as ts

import storage_io
from dist_ckpt.errors import StorageError
from dist_ckpt.location import Location
from dist_ckpt.retries import retry_policy, tensorstore_retries
from storage_io import RetryPolicy

# Bounded concurrency of deletes and copies in a bucket (each a request; copies hold one object in memory).
_WINDOW = 16
_STATUS = re.compile(r"^([A-Z_]+): ")
_UNREACHABLE = {"ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}


def tensorstore_status(error: BaseException) -> str:
    """The canonical status code at the start of a tensorstore error message ("" when there is none)."""
    match = _STATUS.match(str(error))
    return match.group(1) if match else ""


# dist_ckpt's kinds of failure (StorageError.reason) from storage_io's, and the fix it gives for each.
_REASONS = {
    "full": "full",
    "denied": "denied",
    "no_credentials": "denied",
    "unreachable": "unreachable",
    "no_bucket": "no_bucket",
}


def _reason(error: BaseException) -> str:
    status = tensorstore_status(error)
    detail = str(error)
    if status in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
        return "denied"
    if "quota" in detail.lower():
        return "full"
    if status in _UNREACHABLE or "CURL error" in detail or "Could not connect" in detail:
        return "unreachable"
    if status == "NOT_FOUND" and "bucket" in detail.lower():
        return "no_bucket"
    return _REASONS.get(storage_io.classify(error), "other")


def storage_error(error: BaseException, url: str, doing: str) -> StorageError:
    """A StorageError for a failed `doing` (e.g. "write") of `url`, with the fix for its kind of failure."""
    reason = _reason(error)
    if reason == "denied":
        fix = (
            "access was denied. Give this process access to it: fix the file's permissions (ls -l), or the "
            "credentials of the bucket (the AWS_* variables for s3, Application Default Credentials for gs)"
        )
    elif reason == "full":
        fix = (
            "the disk is full. Free space there, keep fewer checkpoints (the Checkpointer's keep and "
            "save_interval), or save under a root with more room"
        )
    elif reason == "unreachable":
        fix = (
            f"the storage did not answer ({retry_policy().describe()} of retries with exponential backoff). "
            "Check that the server is up and reachable (AWS_ENDPOINT_URL or STORAGE_EMULATOR_HOST, the "
            "network), then run again"
        )
    elif reason == "no_bucket":
        fix = "the bucket does not exist. Create it, or fix the bucket name in the checkpoint URL"
    else:
        fix = "see the cause above"
    return StorageError(f"Could not {doing} {url}: {error}. {fix[0].upper()}{fix[1:]}.", url=url, reason=reason)


@functools.lru_cache(maxsize=8)
def _context(policy: RetryPolicy) -> ts.Context:
    return ts.Context(tensorstore_retries(policy))


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


def write_bytes(location: Location, key: str, data: bytes) -> None:
    """Write `key` so that readers see either nothing or all of it, durably (one PUT in a bucket)."""
    url = location.url_of(key)
    if not location.is_local:
        _remote(_kvstore(location).write(key, data), url, "write")
        return
    try:  # a temporary file with the umask's mode (not mkstemp's 0600, which hides it from the group), renamed
        storage_io.write_local_atomic(url, data)
    except OSError as error:
        raise storage_error(error, url, "write") from None


def write_json(location: Location, key: str, content: Any) -> None:
    """Write `content` as JSON to `key` (see write_bytes)."""
    write_bytes(location, key, json.dumps(content, indent=1, sort_keys=True).encode())


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
    if location.scheme == "gs":
        # Not tensorstore's gcs listing: it cuts the prefix off each listed name with a C++ substr that throws
        # out_of_range, uncaught, when a server lists a name outside the range asked for (gcp-storage-emulator
        # ignores startOffset/endOffset), and that aborts the whole interpreter (exit 134). gcsfs asks with
        # `prefix` and raises a Python exception at worst.
        return storage_io.list_keys(str(location), error=storage_error)
    # The listing is of the directory's own kvstore, so the prefix goes to the server as such.
    keys = _remote(_kvstore(location).list(), str(location), "list")
    return sorted(key.decode() for key in keys)


def delete(location: Location, key: str) -> None:
    """Delete `key` below `location` (nothing happens if it is missing)."""
    url = location.url_of(key)
    if location.is_local:
        try:
            Path(url).unlink(missing_ok=True)
            storage_io.fsync_dir(Path(url).parent)
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
