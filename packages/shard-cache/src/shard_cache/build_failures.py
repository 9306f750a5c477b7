"""Builds of this process that failed, by cache URL, so that a reader waiting on that cache stops at once.

A build that fails before its ledger records the error (a full disk, inputs that match nothing) leaves nothing
on storage for a reader to see: without this, a reader in the same process would wait out its whole timeout.
"""

from __future__ import annotations

import threading

_FAILED: dict[str, BaseException] = {}
_LOCK = threading.Lock()


def _key(url: str) -> str:
    return str(url).rstrip("/")


def record_failure(url: str, error: BaseException) -> None:
    """Remember that the build of `url` in this process failed with `error`."""
    with _LOCK:
        _FAILED[_key(url)] = error


def clear_failure(url: str) -> None:
    """Forget an earlier failure of `url`'s build (a new build of it starts)."""
    with _LOCK:
        _FAILED.pop(_key(url), None)


def build_failure(url: str) -> BaseException | None:
    """The error that this process's build of `url` failed with, if it did."""
    with _LOCK:
        return _FAILED.get(_key(url))
