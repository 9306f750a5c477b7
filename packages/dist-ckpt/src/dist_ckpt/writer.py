"""The asynchronous half of a save: tensorstore (or direct) writes and chunk checksums, per-process done files, then the
manifest and the commit marker by process 0."""

import contextlib
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from dist_ckpt.direct_write import DirectWrites, writes_directly
from dist_ckpt.errors import BackgroundSaveError, CheckpointError
from dist_ckpt.integrity import chunk_grid, pack_crcs, region_crcs, write_error
from dist_ckpt.layout import DONE_DIR, MANIFEST, manifest_bytes, write_commit
from dist_ckpt.location import Location
from dist_ckpt.objects import list_keys, read_bytes, write_bytes, write_json
from dist_ckpt.progress import ProgressLine
from dist_ckpt.snapshot import Snapshot
from dist_ckpt.storage import array_spec, make_context, numpy_dtype, open_for_write
from dist_ckpt.workers import start_workers

POLL_SECONDS = 0.05
REMOTE_POLL_SECONDS = 0.25  # each poll of a bucket is one listing request

Crcs = dict[str, dict[int, int]]  # array name -> flat chunk position -> crc32c


class SaveJob:
    """One checkpoint being written by a background thread; `wait()` re-raises its failure."""

    def __init__(
        self,
        *,
        path: Location,
        step: int,
        snapshot: Snapshot,
        manifest: dict[str, Any],
        commit: dict[str, Any],
        process_index: int,
        process_count: int,
        progress: bool,
        commit_timeout: float,
        on_commit: Callable[[], None] | None,
        checksums: bool = True,
        ocdbt_coordinator: str | None = None,
        keep_alive: Any = None,
    ):
        self.location = path
        self.path = path.public()
        self.step = step
        self.snapshot = snapshot
        self.manifest = manifest
        self.commit = commit
        self.process_index = process_index
        self.process_count = process_count
        self.progress = progress
        self.commit_timeout = commit_timeout
        self.on_commit = on_commit
        self.checksums = checksums
        self.ocdbt_coordinator = ocdbt_coordinator
        self.keep_alive = keep_alive  # e.g. the OCDBT coordinator, needed until every process is done
        self.error: BaseException | None = None
        self._error_raised = False
        # Not a daemon: an interpreter that exits right after save() still finishes the write.
        self._thread = threading.Thread(target=self._run, name=f"dist_ckpt save {path.name}", daemon=False)

    def start(self) -> None:
        start_workers()  # from the caller's thread: the job's own may run after the program has ended
        self._thread.start()

    def done(self) -> bool:
        """True once the background write has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the write ends; raise BackgroundSaveError if it failed."""
        self._thread.join()
        if self.error is not None and not self._error_raised:
            # Raised once: by whichever of job.wait() and dist_ckpt.wait() comes first.
            self._error_raised = True
            raise BackgroundSaveError(
                f"The background save of checkpoint {self.location} (step {self.step}) failed: "
                f"{type(self.error).__name__}: {str(self.error).rstrip('.')}. It was not committed, so it will "
                "never be loaded, and earlier checkpoints are intact. Stop and fix the cause before training on "
                "without checkpoints."
            ) from self.error

    def _run(self) -> None:
        try:
            crcs = self._write_arrays()
            if self.process_count > 1:
                done = {"bytes": self.snapshot.nbytes, "chunk_crc32c": {n: _str_keys(c) for n, c in crcs.items()}}
                write_json(self.location, f"{DONE_DIR}/process-{self.process_index}.json", done)
            if self.process_index == 0:
                for other in self._wait_for_other_processes():
                    for name, chunks in other.items():
                        crcs.setdefault(name, {}).update(chunks)
                self._commit(crcs)
        except BaseException as error:
            self.error = error
            if self.process_count > 1:
                self._report_failure(error)
            if not threading.main_thread().is_alive():  # the program has ended: nobody is left to wait() for it
                print(
                    f"dist_ckpt: the background save of checkpoint {self.location} (step {self.step}) failed after "
                    f"the program ended: {type(error).__name__}: {error}. It was not committed; earlier "
                    "checkpoints are intact.",
                    file=sys.stderr,
                )

    def _commit(self, crcs: Crcs) -> None:
        """Process 0, once every array is written: the manifest, then the commit marker, last."""
        if self.checksums:
            for entry in self.manifest["leaves"]:
                if entry["kind"] == "array":
                    count = _chunk_count(entry)
                    entry["chunk_crc32c"] = pack_crcs(crcs.get(entry["array"], {}), count, entry["array"])
        data = manifest_bytes(self.manifest)
        write_bytes(self.location, MANIFEST, data)
        write_commit(self.location, self.commit, data)
        self.keep_alive = None
        if self.on_commit is not None:
            try:
                self.on_commit()
            except Exception as error:  # the checkpoint is committed: a failed clean-up must not undo that
                warnings.warn(
                    f"Checkpoint {self.location} was committed, but the clean-up after it failed: {error}",
                    stacklevel=1,
                )

    def _write_arrays(self) -> Crcs:
        """Write this process's regions; meanwhile compute the checksum of every chunk it writes.

        Local, checksummed, non-OCDBT arrays are written chunk by chunk with plain file writes (direct_write),
        with the crc32c computed once; tensorstore writes the others (and every array's metadata).
        """
        context = make_context(self.ocdbt_coordinator)
        opened = []
        direct_writes = DirectWrites(self.location)
        for array in self.snapshot.arrays:
            entry = array.entry
            if not array.data and self.process_index != 0:
                continue  # nothing of this array lives here, and process 0 writes its metadata
            direct = writes_directly(self.location, checksums=self.checksums, ocdbt=entry["ocdbt"])
            if direct:
                direct_writes.prepare(entry)
            if direct and self.process_index != 0:
                opened.append((array, direct, None))  # no metadata to write, and the chunks bypass tensorstore
                continue
            spec = array_spec(
                self.location,
                entry["array"],
                ocdbt=entry["ocdbt"],
                dtype=numpy_dtype(entry["dtype"]),
                shape=entry["shape"],
                chunk_shape=entry["chunk_shape"],
                checksums=self.checksums,
            )
            opened.append((array, direct, open_for_write(spec, context, create_metadata=self.process_index == 0)))
        writes = []
        crcs: Crcs = {}
        try:
            for array, direct, store_future in opened:
                store = store_future.result() if store_future is not None else None
                for region, data in zip(array.regions, array.data, strict=True):
                    if direct:
                        writes.extend(direct_writes.start_region(array.entry, region, data))
                        continue
                    assert store is not None  # opened for every array that is not written directly
                    index = tuple(slice(start, stop) for start, stop in region)
                    future = store[index].write(data, can_reference_source_data_indefinitely=True)
                    writes.append((future.commit, data.nbytes))
            if self.checksums:  # on this thread, while tensorstore's threads write (crc32c releases the GIL)
                for array, direct, _ in opened:
                    entry = array.entry
                    shape, chunk = tuple(entry["shape"]), tuple(entry["chunk_shape"])
                    for region, data in zip(array.regions, array.data, strict=True):
                        if not direct:
                            crcs.setdefault(entry["array"], {}).update(region_crcs(data, region, chunk, shape))
            line = ProgressLine(
                f"saving {self.location} (step {self.step})",
                self.snapshot.nbytes,
                enabled=self.progress and self.process_index == 0,
            )
            line.wait_all(writes)
            for name, chunks in direct_writes.finish().items():
                crcs.setdefault(name, {}).update(chunks)
        except ValueError as error:
            if "straddles" in str(error):
                raise
            raise write_error(error, self.location) from None
        finally:
            direct_writes.abandon()  # after a failure, no chunk write may outlive the job; a no-op otherwise
        # The host copies are no longer needed; drop them now rather than when the job is collected.
        self.snapshot.arrays.clear()
        return crcs

    def _wait_for_other_processes(self) -> list[Crcs]:
        """Wait for every other process's done file; their chunk checksums."""
        done_dir = self.location.child(DONE_DIR)
        deadline = time.monotonic() + self.commit_timeout
        pending = set(range(1, self.process_count))
        reports: list[Crcs] = []
        poll = POLL_SECONDS if self.location.is_local else REMOTE_POLL_SECONDS
        while pending:
            present = set(list_keys(done_dir))
            for index in sorted(pending):
                if f"process-{index}.failed" in present:
                    failure = json.loads(read_bytes(done_dir, f"process-{index}.failed") or b"{}")
                    raise CheckpointError(
                        f"Process {index} failed to write its shards of {self.location}: {failure.get('error')}"
                    )
                if f"process-{index}.json" in present:
                    report = json.loads(read_bytes(done_dir, f"process-{index}.json") or b"{}")
                    reports.append({n: _int_keys(c) for n, c in report.get("chunk_crc32c", {}).items()})
                    pending.discard(index)
            if pending and time.monotonic() > deadline:
                raise CheckpointError(
                    f"Processes {sorted(pending)} did not finish writing {self.location} within "
                    f"{self.commit_timeout:.0f} s, so it was not committed. Check those processes' logs; "
                    "raise commit_timeout if their storage is just slow."
                )
            if pending:
                time.sleep(poll)
        return reports

    def _report_failure(self, error: BaseException) -> None:
        """Tell process 0 (through the shared storage) not to wait for this process any longer."""
        # If the storage itself failed, process 0 times out instead; this error is still raised here.
        with contextlib.suppress(CheckpointError, OSError):
            write_json(
                self.location,
                f"{DONE_DIR}/process-{self.process_index}.failed",
                {"error": f"{type(error).__name__}: {error}"},
            )


def _chunk_count(entry: dict[str, Any]) -> int:
    grid = chunk_grid(tuple(entry["shape"]), tuple(entry["chunk_shape"]))
    count = 1
    for size in grid:
        count *= size
    return count


def _str_keys(crcs: dict[int, int]) -> dict[str, int]:
    return {str(flat): crc for flat, crc in crcs.items()}


def _int_keys(crcs: dict[str, int]) -> dict[int, int]:
    return {int(flat): crc for flat, crc in crcs.items()}
