"""What every process must do alike after a step (stop, save a checkpoint), decided by process 0 alone."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import dist_ckpt
from lm_train.run.signals import StopRequest

CLOCK_SKEW_ENV = "LM_TRAIN_TEST_CLOCK_SKEW_S"


def checkpoint_clock() -> Callable[[], float]:
    """The clock that times temporary checkpoints: time.monotonic, unless a test skews this process's clock.

    With LM_TRAIN_TEST_CLOCK_SKEW_S=S, every reading after the first (the one the save timer starts from) is S
    seconds ahead: the clock jumps by S as a host's clock does when it is stepped, so that a process deciding
    with its own clock would see the save interval long passed where process 0 does not.
    """
    skew = float(os.environ.get(CLOCK_SKEW_ENV, "0") or 0)
    if not skew:
        return time.monotonic
    readings = 0

    def skewed() -> float:
        nonlocal readings
        readings += 1
        return time.monotonic() + (skew if readings > 1 else 0.0)

    return skewed


class StepDecisions:
    """Process 0's stop and save decisions for each step, shared in the stop request's one exchange of the step.

    Hosts whose clocks differ never disagree about a time-based save: only process 0's clock is read, and the
    other processes save the steps it names. No step pays a collective for it (dist_ckpt's own `on_step` would
    broadcast the decision through the devices).
    """

    def __init__(self, stop: StopRequest, checkpointer: dist_ckpt.Checkpointer):
        self.stop = stop
        self.checkpointer = checkpointer

    def after(self, step: int, *, last: bool) -> tuple[bool, dist_ckpt.Decision]:
        """Whether to stop after `step`, and whether (and how) to checkpoint it; the same on every process."""

        def decide(stopping: bool) -> str:  # on process 0 only (or the one process)
            # A stop's checkpoint is temporary unless the keep policy covers it: the rerun's next one replaces it.
            decision = self.checkpointer.policy.decide(step, force=last, force_temporary=stopping)
            return f"{int(decision.save)}{int(decision.temporary)}"

        stopping, payload = self.stop.agree(step, decide)
        return stopping, dist_ckpt.Decision(save=payload[:1] == "1", temporary=payload[1:2] == "1")


__all__ = ["CLOCK_SKEW_ENV", "StepDecisions", "checkpoint_clock"]
