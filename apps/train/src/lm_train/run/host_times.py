"""Each host's own time per step, gathered from every process at log steps, so that a straggler shows."""

from __future__ import annotations

import itertools
import time

GATHER_TIMEOUT_MS = 6 * 3600 * 1000  # process 0 waits at a log step for the others (the watchdog bounds a hang)
_gathers = itertools.count()  # every process makes its gatherers in the same order: same keys everywhere


class HostStepTimes:
    """Times this process's steps over each log window, less the time it waited for the device or the others.

    In a synchronous run every host's wall time per step is the same: the fast hosts wait in the step's
    collectives for the slowest. What differs is the time each spends on its own work between the waits
    (reading its batch, logging, evaluating, anything slow on that host); that is what is measured and
    compared. The waits are the step's dispatch and result, process 0's decision, a checkpoint save's barrier
    and the others' figures at a log step. At a log step each process publishes its figure in jax's
    coordination service and process 0 reads them: a host-side exchange at log steps only, no device collective.
    """

    def __init__(self, process_index: int, process_count: int):
        self.process_index = process_index
        self.process_count = process_count
        self._prefix = f"lm_train/host_times/{next(_gathers)}"
        self._start, self._steps, self._waited = time.perf_counter(), 0, 0.0
        self._last_logged: int | None = None

    def step_done(self) -> None:
        self._steps += 1

    def waited(self, seconds: float) -> None:
        """Seconds this host spent waiting for the device or the other hosts (not its own work)."""
        self._waited += seconds

    def own_time(self) -> float:
        """This host's mean seconds per step in the window so far, without the waits for the device."""
        return max(time.perf_counter() - self._start - self._waited, 0.0) / max(self._steps, 1)

    def gather(self, step: int) -> dict[str, float]:
        """At a log step: `hosts/*` metrics on process 0 (the others return {}); starts the next window.

        Nothing with a single process: there is no other host to compare with.
        """
        own = self.own_time()
        try:
            return self._gathered(step, own)
        finally:  # the next window starts once the others' figures are in: waiting for them is no one's own work
            self._start, self._steps, self._waited = time.perf_counter(), 0, 0.0

    def _gathered(self, step: int, own: float) -> dict[str, float]:
        if self.process_count == 1:
            return {}
        from lm_train.run.distributed import coordination_client

        client = coordination_client()
        client.key_value_set(f"{self._prefix}/{step}/{self.process_index}", repr(own))
        if self.process_index != 0:
            return {}
        times = [own] + [
            float(client.blocking_key_value_get(f"{self._prefix}/{step}/{index}", GATHER_TIMEOUT_MS))
            for index in range(1, self.process_count)
        ]
        if self._last_logged is not None:  # every process has published (and process 0 read) the previous ones
            client.key_value_delete(f"{self._prefix}/{self._last_logged}")  # the key and all under it
        self._last_logged = step
        slowest = max(range(self.process_count), key=lambda index: times[index])
        return {
            "hosts/step_time_max": times[slowest],
            "hosts/step_time_min": min(times),
            "hosts/step_time_mean": sum(times) / len(times),
            "hosts/slowest_host": float(slowest),
        }


__all__ = ["HostStepTimes"]
