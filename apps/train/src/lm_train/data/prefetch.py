"""Prepare the batches of the next steps on a background thread, in step order, ahead of the step."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Prefetcher:
    """Iterates (step, batch) for first_step..last_step-1; `make_batch(step)` runs on its own thread.

    An error of an `end_of_data` type from make_batch ends the iteration after the steps before it (the data ran
    out); it is kept in `ended_by`. Any other error is raised to the consumer.
    """

    _DONE = object()

    def __init__(
        self,
        make_batch: Callable[[int], Any],
        first_step: int,
        last_step: int,
        depth: int = 2,
        end_of_data: tuple[type[BaseException], ...] = (),
    ):
        self._make = make_batch
        self._end_of_data = end_of_data
        self.ended_by: BaseException | None = None
        self.on_wait: Callable[[], None] | None = None  # called when the consumer is about to wait for a batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(first_step, last_step), daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, first: int, last: int) -> None:
        for step in range(first, last):
            if self._stop.is_set():
                return
            try:
                item = (step, self._make(step), None)
            except self._end_of_data as e:
                self.ended_by = e
                self._put(self._DONE)
                return
            except BaseException as e:  # handed to the consumer, raised there
                self._put((step, None, e))
                return
            if not self._put(item):
                return
        self._put(self._DONE)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while True:
            if self.on_wait is not None and self._queue.empty():
                self.on_wait()
            item = self._queue.get()
            if item is self._DONE:
                return
            step, batch, error = item
            if error is not None:
                raise error
            yield step, batch

    def close(self) -> None:
        self._stop.set()
