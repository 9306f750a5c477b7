"""Checking a checkpoint without loading it, and quarantining a damaged one so that no later run trusts it."""

import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import tensorstore as ts

from dist_ckpt.errors import StorageError
from dist_ckpt.integrity import array_error, cells_overlapping, check_trailers, read_trailers
from dist_ckpt.layout import COMMIT_MARKER, CORRUPT_MARKER, QUARANTINE_SUFFIX, read_manifest
from dist_ckpt.location import Location
from dist_ckpt.objects import copy_tree, delete, delete_tree, has_any, storage_error, write_json
from dist_ckpt.reading import array_url, open_checked
from dist_ckpt.storage import make_context, open_for_read

# Chunks whose checksums (or, with read_data, whose data) are read at a time: bounds memory and requests.
_WINDOW_CHUNKS = 256
_WINDOW_BYTES = 256 * 2**20


def verify(path: str | os.PathLike, *, read_data: bool = False) -> dict[str, Any]:
    """Check that the committed checkpoint at `path` is intact; return its manifest.

    Without `read_data` it is cheap (a few bytes per chunk): the markers, the manifest's checksum, each array's
    stored metadata, and that every chunk file is there, whole, with the checksum the manifest records. With
    `read_data=True` every chunk is also read and checked against its checksum, which catches a flipped bit
    anywhere. Raises CorruptCheckpointError (or CheckpointError for a torn one) naming the first damaged file.
    Checkpoints of dist-ckpt 0.1 have no checksums: for them only the metadata and, with read_data, the
    readability of every chunk are checked.
    """
    location = Location.parse(path)
    manifest = read_manifest(location)
    context = make_context()
    entries = [entry for entry in manifest["leaves"] if entry["kind"] == "array"]
    opened = [(entry, open_for_read(location, entry, context)) for entry in entries]
    stores = [(entry, open_checked(location, entry, future)) for entry, future in opened]
    for entry, store in stores:
        if "chunk_crc32c" in entry:
            _check_every_trailer(location, entry, store)
    if read_data:
        for entry, store in stores:
            _read_every_chunk(location, entry, store)
    return manifest


def _all_cells(entry: dict[str, Any]) -> list[tuple[int, ...]]:
    whole = tuple((0, size) for size in entry["shape"])
    return cells_overlapping(whole, tuple(entry["chunk_shape"]))


def _check_every_trailer(location: Location, entry: dict[str, Any], store: ts.TensorStore) -> None:
    cells = _all_cells(entry)
    for start in range(0, len(cells), _WINDOW_CHUNKS):
        batch = ts.Batch()
        pending = read_trailers(store, entry, cells[start : start + _WINDOW_CHUNKS], batch)
        batch.submit()
        check_trailers(location, entry, pending, array_url(location, entry))


def _read_every_chunk(location: Location, entry: dict[str, Any], store: ts.TensorStore) -> None:
    chunk = tuple(entry["chunk_shape"])
    per_window = max(1, _WINDOW_BYTES // max(1, math.prod(chunk) * store.dtype.numpy_dtype.itemsize))
    cells = _all_cells(entry)
    for start in range(0, len(cells), per_window):
        futures = []
        for cell in cells[start : start + per_window]:
            index = tuple(
                slice(i * size, min((i + 1) * size, extent))
                for i, size, extent in zip(cell, chunk, entry["shape"], strict=True)
            )
            futures.append(store[index].read())
        for future in futures:
            try:
                future.result()
            except ValueError as error:
                raise array_error(error, location, entry, array_url(location, entry)) from None


def quarantine(path: str | os.PathLike, *, reason: str | BaseException = "", key: str | None = None) -> Path | str:
    """Rename the checkpoint at `path` to `step-N.corrupt` (then `.corrupt-2`, ...) so that no run trusts it;
    returns the new path or URL. Call it on one process (process 0) only.

    The commit marker is removed first and a CORRUPT marker (with `reason`) written, so the checkpoint is never
    loaded from then on, even if the move is interrupted. Local directories are renamed; in a bucket, where
    there is no rename, the objects are copied to the new prefix and then deleted, the CORRUPT marker last.
    """
    location = Location.parse(path)
    if isinstance(reason, BaseException):
        key = key if key is not None else getattr(reason, "key", None)
        reason = f"{type(reason).__name__}: {reason}"
    target = _free_name(location)
    delete(location, COMMIT_MARKER)
    marker = {
        "reason": reason or "quarantined by dist_ckpt.quarantine",
        "key": key,
        "time": datetime.fromtimestamp(time.time(), UTC).isoformat(),
        "quarantined_from": str(location),
        "quarantined_to": str(target),
    }
    write_json(location, CORRUPT_MARKER, marker)
    if location.is_local:
        try:
            os.rename(location.path, target.path)
        except OSError as error:
            raise storage_error(error, str(location), f"rename to {target}") from None
    else:
        copy_tree(location, target)
        delete_tree(location, last=[CORRUPT_MARKER])
    return target.public()


def _free_name(location: Location) -> Location:
    for attempt in range(1, 1000):
        suffix = QUARANTINE_SUFFIX if attempt == 1 else f"{QUARANTINE_SUFFIX}-{attempt}"
        candidate = location.sibling(location.name + suffix)
        if not has_any(candidate):
            return candidate
    raise StorageError(f"Too many quarantined copies of {location}: delete some.", url=str(location))
