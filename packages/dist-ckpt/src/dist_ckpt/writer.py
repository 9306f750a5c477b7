"""The asynchronous half of a save: tensorstore writes, per-process done files, the commit by process 0."""

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dist_ckpt.errors import BackgroundSaveError, CheckpointError
from dist_ckpt.layout import COMMIT_MARKER, DONE_DIR, MANIFEST, write_json_atomically
from dist_ckpt.progress import ProgressLine
from dist_ckpt.snapshot import Snapshot
from dist_ckpt.storage import array_spec, make_context, numpy_dtype, open_for_write

POLL_SECONDS = 0.05


class SaveJob:
    """One checkpoint being written by a background thread; `wait()` re-raises its failure."""

    def __init__(
        self,
        *,
        path: Path,
        step: int,
        snapshot: Snapshot,
        manifest: dict[str, Any],
        commit: dict[str, Any],
        process_index: int,
        process_count: int,
        progress: bool,
        commit_timeout: float,
        on_commit: Callable[[], None] | None,
        ocdbt_coordinator: str | None = None,
        keep_alive: Any = None,
    ):
        self.path = path
        self.step = step
        self.snapshot = snapshot
        self.manifest = manifest
        self.commit = commit
        self.process_index = process_index
        self.process_count = process_count
        self.progress = progress
        self.commit_timeout = commit_timeout
        self.on_commit = on_commit
        self.ocdbt_coordinator = ocdbt_coordinator
        self.keep_alive = keep_alive  # e.g. the OCDBT coordinator, needed until every process is done
        self.error: BaseException | None = None
        self._error_raised = False
        # Not a daemon: an interpreter that exits right after save() still finishes the write.
        self._thread = threading.Thread(target=self._run, name=f"dist_ckpt save {path.name}", daemon=False)

    def start(self) -> None:
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
                f"The background save of checkpoint {self.path} (step {self.step}) failed: "
                f"{type(self.error).__name__}: {self.error}. It was not committed, so it will never be "
                "loaded and earlier checkpoints are intact; fix the cause (disk space, permissions, the "
                "failing process) and save again."
            ) from self.error

    def _run(self) -> None:
        try:
            self._write_arrays()
            if self.process_count > 1:
                write_json_atomically(
                    self.path / DONE_DIR / f"process-{self.process_index}.json",
                    {"bytes": self.snapshot.nbytes},
                )
            if self.process_index == 0:
                self._wait_for_other_processes()
                write_json_atomically(self.path / COMMIT_MARKER, self.commit)
                self.keep_alive = None
                if self.on_commit is not None:
                    self.on_commit()
        except BaseException as error:
            self.error = error
            if self.process_count > 1:
                self._report_failure(error)

    def _write_arrays(self) -> None:
        if self.process_index == 0:
            write_json_atomically(self.path / MANIFEST, self.manifest)
        context = make_context(self.ocdbt_coordinator)
        opened = []
        for array in self.snapshot.arrays:
            entry = array.entry
            if not array.data and self.process_index != 0:
                continue  # nothing of this array lives here, and process 0 writes its metadata
            spec = array_spec(
                self.path,
                entry["array"],
                ocdbt=entry["ocdbt"],
                dtype=numpy_dtype(entry["dtype"]),
                shape=entry["shape"],
                chunk_shape=entry["chunk_shape"],
            )
            opened.append((array, open_for_write(spec, context, create_metadata=self.process_index == 0)))
        writes = []
        for array, store_future in opened:
            store = store_future.result()
            for region, data in zip(array.regions, array.data, strict=True):
                index = tuple(slice(start, stop) for start, stop in region)
                future = store[index].write(data, can_reference_source_data_indefinitely=True)
                writes.append((future.commit, data.nbytes))
        line = ProgressLine(
            f"saving {self.path} (step {self.step})",
            self.snapshot.nbytes,
            enabled=self.progress and self.process_index == 0,
        )
        line.wait_all(writes)
        # The host copies are no longer needed; drop them now rather than when the job is collected.
        self.snapshot.arrays.clear()

    def _wait_for_other_processes(self) -> None:
        done_dir = self.path / DONE_DIR
        deadline = time.monotonic() + self.commit_timeout
        pending = set(range(1, self.process_count))
        while pending:
            for index in sorted(pending):
                failed = done_dir / f"process-{index}.failed"
                if failed.exists():
                    raise CheckpointError(
                        f"Process {index} failed to write its shards of {self.path}: "
                        f"{json.loads(failed.read_text())['error']}"
                    )
                if (done_dir / f"process-{index}.json").exists():
                    pending.discard(index)
            if pending and time.monotonic() > deadline:
                raise CheckpointError(
                    f"Processes {sorted(pending)} did not finish writing {self.path} within "
                    f"{self.commit_timeout:.0f} s, so it was not committed. Check those processes' logs; "
                    "raise commit_timeout if their disks are just slow."
                )
            if pending:
                time.sleep(POLL_SECONDS)

    def _report_failure(self, error: BaseException) -> None:
        """Tell process 0 (through the shared file system) not to wait for this process any longer."""
        # If the disk itself failed, process 0 times out instead; this error is still raised here.
        with contextlib.suppress(OSError):
            write_json_atomically(
                self.path / DONE_DIR / f"process-{self.process_index}.failed",
                {"error": f"{type(error).__name__}: {error}"},
            )
