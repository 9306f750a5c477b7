"""The threads that read and write checkpoint files directly (direct_read, direct_write)."""

import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable
from typing import Any


class Workers:
    """Daemon threads that run submitted calls, each returning a Future.

    Not a ThreadPoolExecutor: that one refuses new work once the interpreter starts to exit, and a program that
    ends right after save() leaves the save's (non-daemon) job thread running, which must still write every chunk
    (a load started on a thread of its own at exit must likewise still read).
    The job thread waits for every call it submits, so no call is cut short when the daemon threads stop. Python
    3.12 starts no thread once the interpreter exits, so save() starts them first (`start`); where they could not
    be started, a call runs in the thread that submits it.
    """

    def __init__(self, count: int):
        self.count = count
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.started = 0
        os.register_at_fork(after_in_child=self._forget_threads)  # a forked child has none of them

    def start(self) -> None:
        """Start the threads not yet running (for as long as the interpreter lets new threads start)."""
        with self.lock:
            while self.started < self.count:
                try:
                    threading.Thread(target=self._run, name="dist_ckpt files", daemon=True).start()
                except RuntimeError:  # "can't create new thread at interpreter shutdown"
                    return
                self.started += 1

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.start()
        if self.started:
            self.queue.put((future, fn, args))
        else:
            _call(future, fn, args)
        return future

    def _run(self) -> None:
        while True:
            # One call per helper frame, so that an idle thread holds no reference to the last chunk it wrote
            # (a view that would keep the save's whole host copy of its shard alive).
            _call(*self.queue.get())

    def _forget_threads(self) -> None:
        self.queue, self.lock, self.started = queue.SimpleQueue(), threading.Lock(), 0


def _call(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return  # cancelled before it started
    try:
        result = fn(*args)
    except BaseException as error:
        future.set_exception(error)
    else:
        future.set_result(result)


# As many files in flight as make_context lets tensorstore have: reads, writes, fsyncs and crc32c release the GIL.
FILE_WORKERS = Workers(max(16, os.cpu_count() or 1))
start_workers = FILE_WORKERS.start
