"""SIGTERM and SIGINT ask the loop to checkpoint and stop after the current step (preemption)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import numpy as np


class StopRequest:
    """Catches the stop signals while the loop runs; `restore()` puts the previous handlers back."""

    def __init__(self, process_count: int):
        self.flag = False
        self.signum: int | None = None  # the signal that asked, for the exit status (128 + signum)
        self.process_count = process_count
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.flag and signum == signal.SIGINT:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.flag = True
        self.signum = signum

    def requested(self, check_all: bool) -> bool:
        """Whether to stop now; with several processes they agree (at log steps), so all save together."""
        if self.process_count == 1:
            return self.flag
        if not check_all:
            return False
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.flag))
        return bool(np.any(flags))

    def exit_status(self) -> int:
        """128 + the signal's number, as shells report a job ended by a signal (SIGTERM when another process got it)."""
        return 128 + (self.signum or signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
