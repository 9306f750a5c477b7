"""A progress line with rate and ETA for long saves and loads, printed only by process 0."""

import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


class ProgressLine:
    """Reports `done/total` bytes with rate and ETA every `interval` seconds, once the work is slow enough.

    Nothing is printed for work that ends before the first interval, so short saves stay quiet.
    """

    def __init__(
        self,
        label: str,
        total_bytes: int,
        *,
        enabled: bool = True,
        interval: float = 5.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label = label
        self.total_bytes = total_bytes
        self.enabled = enabled
        self.interval = interval
        self.stream = stream
        self.clock = clock
        self.start = clock()
        self.last_report = self.start
        self.reported = False

    def update(self, done_bytes: int) -> None:
        """Print a progress line if `interval` seconds passed since the last one."""
        now = self.clock()
        if self.enabled and now - self.last_report >= self.interval:
            self.last_report = now
            self.reported = True
            elapsed = max(now - self.start, 1e-9)
            rate = done_bytes / elapsed
            eta = (self.total_bytes - done_bytes) / rate if rate > 0 else float("inf")
            percent = 100.0 * done_bytes / max(self.total_bytes, 1)
            self._print(
                f"{self.label}: {_gib(done_bytes)} / {_gib(self.total_bytes)} ({percent:.0f}%), "
                f"{rate / 2**20:.0f} MiB/s, ETA {eta:.0f} s"
            )

    def wait_all(self, pending: Iterable[tuple[Any, int]]) -> list[Any]:
        """Wait for each (future, bytes) in turn, reporting progress meanwhile, then finish; the results."""
        results, done_bytes = [], 0
        for future, nbytes in pending:
            while True:
                try:
                    results.append(future.result(timeout=1.0))
                    break
                except TimeoutError:
                    self.update(done_bytes)
            done_bytes += nbytes
            self.update(done_bytes)
        self.finish()
        return results

    def finish(self) -> None:
        """Print the closing line (total, time, rate) if any progress line was printed."""
        if self.enabled and self.reported:
            elapsed = max(self.clock() - self.start, 1e-9)
            self._print(
                f"{self.label}: done, {_gib(self.total_bytes)} in {elapsed:.1f} s "
                f"({self.total_bytes / elapsed / 2**20:.0f} MiB/s)"
            )

    def _print(self, line: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        print(f"dist_ckpt: {line}", file=stream, flush=True)
