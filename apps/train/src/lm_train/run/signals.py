"""SIGTERM and SIGINT ask the loop to checkpoint and stop after the current step (preemption)."""

from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Callable
from typing import Any

AGREE_TIMEOUT_MS = 6 * 3600 * 1000  # process 0 may be alone in long work between steps (an export, an eval)
_requests = itertools.count()  # every process makes its stop requests in the same order: same keys everywhere


class StopRequest:
    """Catches the stop signals while the loop runs; `restore()` puts the previous handlers back."""

    def __init__(self, process_count: int):
        self.flag = False
        self.signum: int | None = None  # the signal that asked, for the exit status (128 + signum)
        self.process_count = process_count
        self._prefix = f"lm_train/stop/{next(_requests)}"
        self._announced = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.flag and signum == signal.SIGINT:  # a second Ctrl-C means now
            raise KeyboardInterrupt
        self.flag = True
        self.signum = signum

    def requested(self, step: int) -> bool:
        """Whether to stop after `step`; with several processes they agree at every step, so all save together."""
        return self.agree(step)[0]

    def agree(self, step: int, decide: Callable[[bool], str] | None = None) -> tuple[bool, str]:
        """Whether to stop after `step`, and `decide(stop)` as process 0 computed it (a short string): other
        decisions that every process must share ride along in the step's one exchange, at no extra cost."""
        decide = decide or (lambda stop: "")
        if self.process_count == 1:
            return self.flag, decide(self.flag)
        return self._agreed(step, decide)

    def _agreed(self, step: int, decide: Callable[[bool], str]) -> tuple[bool, str]:
        # Process 0 decides for each step and publishes it in jax's coordination service: a host-side exchange,
        # so it never waits for the device (a device all-gather would queue behind the running steps).
        import jax

        from lm_train.run.distributed import coordination_client

        client = coordination_client()
        index = jax.process_index()
        if self.flag and not self._announced:
            client.key_value_set(f"{self._prefix}/asked/{index}", "1")
            self._announced = True
        key = f"{self._prefix}/step/{step}"
        if index == 0:
            stop = self.flag or bool(client.key_value_dir_get(f"{self._prefix}/asked/"))
            payload = decide(stop)
            client.key_value_set(key, ("1" if stop else "0") + payload)
            if step > 64:  # every process has read it: none is more than a step or two behind
                client.key_value_delete(f"{self._prefix}/step/{step - 64}")
            return stop, payload
        value = client.blocking_key_value_get(key, AGREE_TIMEOUT_MS)
        return value[:1] == "1", value[1:]

    def exit_status(self) -> int:
        """128 + the signal's number, as shells report a job ended by a signal (SIGTERM when another process got it)."""
        return 128 + (self.signum or signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
