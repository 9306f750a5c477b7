"""The builder's lock on a cache directory: one live builder at a time; a dead builder's lock is taken over.

The lock is a series of files `.locks/<epoch>.json`; the holder is the writer of the highest epoch. Taking the
lock creates the next epoch's file exclusively (local disk: a hard link; S3: `If-None-Match: *`; GCS:
`ifGenerationMatch=0`), so of two builders racing for a free or dead lock exactly one wins, with no rename and
no delete in the race. Taking over a dead holder's lock is the same step: the new epoch supersedes its file,
whatever that builder does later. Where a store ignores the precondition (gcp-storage-emulator does), the
creator reads its file back and backs off when another builder overwrote it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

import fsspec

from shard_cache.errors import CacheLockedError
from shard_cache.fs import create_exclusive, is_local, join, list_names, read_bytes, remove, write_atomic

LOCKS_DIR = ".locks"
LEGACY_LOCK = ".lock"  # the single lock file of shard-cache 0.1/0.2
# A lock whose heartbeat is older than this, held from another host, is taken to be dead.
STALE_AFTER_S = 120.0
TRIES = 5


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _epoch_name(epoch: int) -> str:
    return f"{epoch:08d}.json"


def _epochs(fs: fsspec.AbstractFileSystem, root: str) -> list[int]:
    names = list_names(fs, join(root, LOCKS_DIR))
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _read_info(fs: fsspec.AbstractFileSystem, path: str) -> dict | None:
    try:
        info = json.loads(read_bytes(fs, path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}  # not ours, or damaged: no live holder can be read from it
    return info if isinstance(info, dict) else {}


def _holder_is_dead(info: dict) -> bool:
    if info.get("released"):
        return True
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
        return not _pid_alive(info["pid"])
    try:
        return time.time() - float(info.get("heartbeat", 0)) > STALE_AFTER_S
    except (TypeError, ValueError):
        return True


@dataclass
class BuildLock:
    """A held lock; `token` identifies this builder in the lock file of its `epoch`."""

    fs: fsspec.AbstractFileSystem
    root: str
    token: str
    epoch: int = 0

    @property
    def path(self) -> str:
        return join(self.root, LOCKS_DIR, _epoch_name(self.epoch))

    def _payload(self) -> bytes:
        info = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
        return json.dumps(info).encode("utf-8")

    def still_held(self) -> bool:
        """True while this builder's epoch is the newest and its file still names this builder."""
        epochs = _epochs(self.fs, self.root)
        if not epochs or epochs[-1] != self.epoch:
            return False
        info = _read_info(self.fs, self.path)
        return info is not None and info.get("token") == self.token

    def heartbeat(self) -> None:
        """Refresh the heartbeat so that builders on other hosts see this one alive; raises if the lock is lost."""
        if not self.still_held():
            raise self.lost()
        write_atomic(self.fs, self.path, self._payload())

    def lost(self) -> CacheLockedError:
        return CacheLockedError(
            f"{self.root}: this build lost its lock to another builder (its heartbeat was older than "
            f"{STALE_AFTER_S:.0f} s); it stops without writing more. The other builder carries the build on."
        )

    def release(self) -> None:
        """Remove the lock if this builder still holds it."""
        if self.still_held():
            remove(self.fs, self.path)
            if is_local(self.fs):  # object stores have no directories to leave behind
                with contextlib.suppress(OSError):  # not empty: another builder's epoch appeared
                    os.rmdir(join(self.root, LOCKS_DIR))


def _check_legacy_lock(fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
    path = join(root, LEGACY_LOCK)
    info = _read_info(fs, path)
    if info is None:
        return
    if not _holder_is_dead(info):
        raise _locked(url, info, path)
    remove(fs, path)


def _locked(url: str, info: dict, path: str) -> CacheLockedError:
    return CacheLockedError(
        f"{url}: another builder holds the lock (host {info.get('host')}, pid {info.get('pid')}, file {path}). "
        f"Wait for it to finish, or build into another directory. If that builder is gone, delete {path} and run "
        "again."
    )


def acquire(fs: fsspec.AbstractFileSystem, root: str, url: str) -> BuildLock:
    """Take the lock on the cache at `root`, or raise CacheLockedError naming the live holder."""
    _check_legacy_lock(fs, root, url)
    for _ in range(TRIES):
        epochs = _epochs(fs, root)
        if epochs:
            current = join(root, LOCKS_DIR, _epoch_name(epochs[-1]))
            info = _read_info(fs, current)
            if info is None:
                continue  # released between the listing and the read
            if not _holder_is_dead(info):
                raise _locked(url, info, current)
        lock = BuildLock(fs=fs, root=root, token=uuid.uuid4().hex, epoch=(epochs[-1] + 1) if epochs else 1)
        try:
            create_exclusive(fs, lock.path, lock._payload())
        except FileExistsError:
            continue  # another builder took this epoch first
        if not lock.still_held():
            continue
        for old in epochs:  # superseded: their holders are dead
            remove(fs, join(root, LOCKS_DIR, _epoch_name(old)))
        return lock
    raise CacheLockedError(f"{url}: could not take the lock under {join(root, LOCKS_DIR)} after {TRIES} tries; retry.")
