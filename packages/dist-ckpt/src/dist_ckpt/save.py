"""`save` and `wait`: asynchronous, atomic checkpoints of any pytree, one background write at a time."""

import importlib.metadata
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dist_ckpt.distributed import barrier, process_count, process_index
from dist_ckpt.errors import CheckpointExistsError
from dist_ckpt.layout import FORMAT_NAME, FORMAT_VERSION, delete_checkpoint, is_committed
from dist_ckpt.location import Location
from dist_ckpt.objects import has_any, storage_error
from dist_ckpt.ocdbt import coordinator_address, start_coordinator
from dist_ckpt.snapshot import check_metadata, take_snapshot, total_bytes
from dist_ckpt.writer import SaveJob

_lock = threading.Lock()
_in_flight: SaveJob | None = None


def wait() -> None:
    """Block until the pending background save (if any) is committed; raise its error if it failed."""
    global _in_flight
    with _lock:
        job, _in_flight = _in_flight, None
    if job is not None:
        job.wait()


def raise_if_failed() -> None:
    """Raise the error of a background save that has already failed, without waiting for one in progress."""
    global _in_flight
    with _lock:
        job = _in_flight
        if job is None or not job.done():
            return
        _in_flight = None
    job.wait()


def _prepare_directory(path: Location, *, ocdbt: bool) -> tuple[Any, str | None]:
    """Refuse to overwrite a complete checkpoint; clear a torn one left by an earlier, killed save.

    For a multi-process OCDBT save, also start the coordinator (process 0) and return (server, address).
    """
    if path.is_local and Path(path.path).exists() and not Path(path.path).is_dir():
        raise CheckpointExistsError(
            f"Cannot save a checkpoint to {path}: a file (not a checkpoint directory) is there. Choose another "
            "path, or move the file away."
        )
    if is_committed(path):
        raise CheckpointExistsError(
            f"Checkpoint {path} already exists and is complete; dist_ckpt never overwrites one. Save to "
            "another path (e.g. another step), or delete it first if you really mean to replace it."
        )
    if process_index() == 0:
        if has_any(path):
            warnings.warn(
                f"Replacing torn checkpoint {path} (no commit marker: an earlier save of it never finished).",
                stacklevel=3,
            )
            delete_checkpoint(path)
        if path.is_local:
            try:
                Path(path.path).mkdir(parents=True)
            except OSError as error:  # a full disk or a read-only root: the same clear error as a failed write
                raise storage_error(error, str(path), "create") from None
    shared_ocdbt = ocdbt and process_count() > 1
    server = start_coordinator(path) if shared_ocdbt and process_index() == 0 else None
    barrier(f"dist_ckpt prepared {path}")
    return server, coordinator_address(path) if shared_ocdbt else None


def _version() -> str:
    try:
        return importlib.metadata.version("dist-ckpt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def save(
    tree: Any,
    path: str | os.PathLike | Location,
    *,
    step: int,
    metadata: Mapping[str, Any] | None = None,
    temporary: bool = False,
    ocdbt: bool = False,
    checksums: bool = True,
    block: bool = False,
    progress: bool = True,
    commit_timeout: float = 3600.0,
    on_commit: Callable[[], None] | None = None,
) -> SaveJob:
    """Save `tree` to the checkpoint directory `path`; returns once the arrays are copied off the devices.

    `path` is a local path, a file:// URL, or an s3:// or gs:// URL. Every process calls it with the same
    tree; each writes only its own shards. The write goes on in the background; `wait()` (or the next
    `save`) blocks until it is committed and raises its error if it failed. `temporary` marks it deletable by
    a `Checkpointer` once a newer checkpoint is complete; `ocdbt` packs all arrays into one OCDBT database
    instead of one directory per array (with several processes, process 0 runs the coordinator for it);
    `checksums=False` leaves out the crc32c of every chunk (and the manifest's digests), which `load` and
    `verify` check; `block=True` waits for the commit before returning; `on_commit` runs on process 0 after it.
    """
    path = Location.parse(path)
    wait()  # one save at a time, and the previous one's failure surfaces here
    step = int(step)
    user_metadata = check_metadata(metadata, str(path))
    snapshot = take_snapshot(tree, ocdbt=ocdbt)
    saved_at = time.time()
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "writer": f"dist-ckpt {_version()}",
        "checksums": "crc32c" if checksums else None,
        "step": step,
        "time": datetime.fromtimestamp(saved_at, UTC).isoformat(),
        "unix_time": saved_at,
        "metadata": user_metadata,
        "process_count": process_count(),
        "total_bytes": total_bytes(snapshot.entries),
        "leaves": snapshot.entries,
    }
    commit = {"step": step, "temporary": temporary, "time": manifest["time"]}
    server, ocdbt_coordinator = _prepare_directory(path, ocdbt=ocdbt)
    job = SaveJob(
        path=path,
        step=step,
        snapshot=snapshot,
        manifest=manifest,
        commit=commit,
        process_index=process_index(),
        process_count=process_count(),
        progress=progress,
        commit_timeout=commit_timeout,
        on_commit=on_commit,
        checksums=checksums,
        ocdbt_coordinator=ocdbt_coordinator,
        keep_alive=server,
    )
    global _in_flight
    with _lock:
        _in_flight = job
    job.start()
    if block:
        wait()
    return job
