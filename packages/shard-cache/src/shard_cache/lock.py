"""The builder's lock on a cache directory: one live builder at a time; a dead builder's lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

import fsspec

from shard_cache.errors import CacheLockedError
from shard_cache.fs import is_local, join, write_atomic

LOCK_NAME = ".lock"
# A lock whose heartbeat is older than this, held from another host, is taken to be dead.
STALE_AFTER_S = 120.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class BuildLock:
    """A held lock; `token` identifies this builder in the lock file."""

    fs: fsspec.AbstractFileSystem
    root: str
    token: str

    @property
    def path(self) -> str:
        return join(self.root, LOCK_NAME)

    def _payload(self) -> bytes:
        info = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
        return json.dumps(info).encode("utf-8")

    def heartbeat(self) -> None:
        """Refresh the heartbeat so that builders on other hosts see this one alive."""
        write_atomic(self.fs, self.path, self._payload())

    def still_held(self) -> bool:
        """True while the lock file still names this builder."""
        try:
            return json.loads(self.fs.cat_file(self.path))["token"] == self.token
        except (FileNotFoundError, ValueError, KeyError):
            return False

    def release(self) -> None:
        """Remove the lock if this builder still holds it."""
        if self.still_held():
            self.fs.rm_file(self.path)


def _holder_is_dead(info: dict) -> bool:
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
        return not _pid_alive(info["pid"])
    return time.time() - float(info.get("heartbeat", 0)) > STALE_AFTER_S


def acquire(fs: fsspec.AbstractFileSystem, root: str, url: str) -> BuildLock:
    """Take the lock on the cache at `root`, or raise CacheLockedError naming the live holder."""
    lock = BuildLock(fs=fs, root=root, token=uuid.uuid4().hex)
    fs.makedirs(root, exist_ok=True)
    for _ in range(3):
        if is_local(fs):
            try:
                fd = os.open(lock.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "wb") as f:
                    f.write(lock._payload())
                return lock
        elif not fs.exists(lock.path):
            lock.heartbeat()
            if lock.still_held():
                return lock
            continue
        try:
            info = json.loads(fs.cat_file(lock.path))
        except FileNotFoundError:
            continue  # released between our attempts
        except ValueError:
            info = {}
        if not _holder_is_dead(info):
            raise CacheLockedError(
                f"{url}: another builder holds the lock (host {info.get('host')}, pid {info.get('pid')}, file "
                f"{lock.path}). Wait for it to finish, or build into another directory. If that builder is "
                f"gone, delete {lock.path} and run again."
            )
        fs.rm_file(lock.path)
    raise CacheLockedError(f"{url}: could not take the lock {lock.path} after 3 tries; try again.")
