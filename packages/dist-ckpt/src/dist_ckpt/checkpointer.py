"""`Checkpointer`: saves a training state on its policy, agreed by all processes, and prunes temporaries."""

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from dist_ckpt.discovery import latest, list_checkpoints
from dist_ckpt.distributed import broadcast_from_process_0, process_index
from dist_ckpt.errors import CheckpointError
from dist_ckpt.layout import delete_checkpoint, step_dir_name
from dist_ckpt.location import Location
from dist_ckpt.policy import Decision, KeepPolicy, SavePolicy
from dist_ckpt.save import raise_if_failed, save, wait
from dist_ckpt.writer import SaveJob

logger = logging.getLogger("dist_ckpt")


class Checkpointer:
    """Saves `root/step-N` checkpoints: temporary ones every `save_interval`, permanent ones per `keep`.

    `root` is a local path or an s3:// / gs:// URL. Call `on_step(tree, step)` every step on every process:
    process 0 decides (with its own clock) and broadcasts the decision, so all processes save the same steps.
    A temporary checkpoint is deleted (by process 0 alone) once a newer checkpoint is complete. A failed
    background save is raised by the next `on_step` or `wait()` as BackgroundSaveError. `wait()` before exiting.
    """

    def __init__(
        self,
        root: str | os.PathLike | Location,
        *,
        save_interval: timedelta | None = timedelta(minutes=15),
        keep: Iterable[KeepPolicy | Mapping[str, Any]] = (),
        clock: Callable[[], float] = time.monotonic,
        ocdbt: bool = False,
        progress: bool = True,
        checksums: bool = True,
    ):
        self.location = Location.parse(root)
        self.root = self.location.public()
        complete = [info for info in list_checkpoints(self.location) if info.committed]
        self.policy = SavePolicy(
            save_interval=save_interval,
            keep=keep,
            clock=clock,
            last_saved_step=complete[-1].step if complete else None,
        )
        self.ocdbt = ocdbt
        self.progress = progress
        self.checksums = checksums

    def decide(self, step: int, *, force: bool = False, force_temporary: bool = False) -> Decision:
        """Process 0's decision for `step`, the same on every process (`force...`: see `SavePolicy.decide`)."""
        step = int(step)
        decision = Decision(save=False)
        if process_index() == 0:
            decision = self.policy.decide(step, force=force, force_temporary=force_temporary)
        agreed = broadcast_from_process_0(np.array([step, int(decision.save), int(decision.temporary)], dtype=np.int32))
        if int(agreed[0]) != step:
            raise CheckpointError(
                f"Checkpointer.on_step: process {process_index()} is at step {step} but process 0 is at step "
                f"{int(agreed[0])}. Every process must call on_step with the same step, every step."
            )
        agreed_decision = Decision(save=bool(agreed[1]), temporary=bool(agreed[2]))
        if agreed_decision.save and process_index() != 0:
            self.policy.record_save(step)
        return agreed_decision

    def on_step(self, tree: Any, step: int, *, force: bool = False, force_temporary: bool = False) -> bool:
        """Save `tree` as step `step` if the policy says so (or `force`: permanent; `force_temporary`: temporary
        unless kept, for a job that is stopping); returns whether it saved."""
        raise_if_failed()  # a failed background write surfaces here, even on steps that do not save
        decision = self.decide(step, force=force, force_temporary=force_temporary)
        if decision.save:
            self.save(tree, int(step), temporary=decision.temporary)
        return decision.save

    def on_agreed_step(self, tree: Any, step: int, decision: Decision) -> bool:
        """Save `tree` as step `step` if `decision` says so, where the caller already shared process 0's decision
        (`self.policy.decide` on process 0) with every process; returns whether it saved.

        `on_step` broadcasts the decision itself, a collective every step; a caller that already exchanges a
        value with every process each step sends the decision along with it instead.
        """
        raise_if_failed()
        if decision.save:
            if process_index() != 0:  # process 0's policy recorded it when it decided
                self.policy.record_save(int(step))
            self.save(tree, int(step), temporary=decision.temporary)
        return decision.save

    def save(
        self, tree: Any, step: int, *, temporary: bool = False, metadata: Mapping[str, Any] | None = None
    ) -> SaveJob:
        """Save now, asynchronously, to `root/step-N` (call on every process)."""
        return save(
            tree,
            self.location.child(step_dir_name(step)),
            step=step,
            metadata=metadata,
            temporary=temporary,
            ocdbt=self.ocdbt,
            checksums=self.checksums,
            progress=self.progress,
            on_commit=lambda: self._delete_older_temporaries(step),
        )

    def latest(self, *, required: bool = False) -> Path | str | None:
        """The newest complete checkpoint under the root (see `dist_ckpt.latest`)."""
        return latest(self.location, required=required)

    def wait(self) -> None:
        """Block until the pending save is committed; raise its error if it failed."""
        wait()

    def _delete_older_temporaries(self, committed_step: int) -> None:
        """Process 0, after the commit of `committed_step`: delete the temporary checkpoints it supersedes."""
        for info in list_checkpoints(self.location):
            if info.committed and info.temporary and info.step < committed_step:
                delete_checkpoint(Location.parse(info.path))
                logger.info("deleted temporary checkpoint %s, superseded by step %d", info.path, committed_step)
