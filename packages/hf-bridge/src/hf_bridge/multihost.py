"""One writer among many processes: process 0 does the file work, and every process learns how it went.

In a multi-process run every process takes part in fetching each tensor (a collective when the tensor is
spread over several hosts), but only process 0 writes. A failure on process 0 (a full disk, a bad tokenizer
path) must not leave the others waiting in the next collective: the writer records it, keeps taking part in
the collectives of the current file, and at each agreement point broadcasts it, so every process raises the
same error at the same place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from .errors import HfBridgeError

T = TypeVar("T")
MESSAGE_BYTES = 4096


class Coordinator:
    """Runs writer-only steps on process 0 and makes every process agree on their outcome."""

    def __init__(self) -> None:
        self.writer = jax.process_index() == 0
        self.multi = jax.process_count() > 1
        self.error: BaseException | None = None

    def run(self, fn: Callable[[], T]) -> T | None:
        """fn() on the writer, unless an earlier step failed; None elsewhere. Single-process, errors raise at once."""
        if not self.writer or self.error is not None:
            return None
        if not self.multi:
            return fn()
        try:
            return fn()
        except Exception as e:  # kept for agree(): every process raises it there
            self.error = e
            return None

    def agree(self) -> None:
        """Raise the writer's error on every process (a collective in a multi-process run)."""
        if not self.multi:
            return
        from jax.experimental import multihost_utils

        text = "" if self.error is None else _describe(self.error)
        message = np.zeros(MESSAGE_BYTES, np.uint8)
        encoded = text.encode("utf-8")[:MESSAGE_BYTES]
        message[: len(encoded)] = np.frombuffer(encoded, np.uint8)
        received = multihost_utils.broadcast_one_to_all(message, is_source=self.writer)
        text = bytes(np.asarray(received, np.uint8)).rstrip(b"\0").decode("utf-8", errors="replace")
        if not text:
            return
        if self.writer and self.error is not None:
            raise self.error
        raise HfBridgeError(f"{text} (reported by process 0, which writes the export)")

    def barrier(self) -> None:
        """Wait until every process gets here."""
        if self.multi:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("hf_bridge export")


def _describe(error: BaseException) -> str:
    if isinstance(error, HfBridgeError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def run_everywhere(co: Coordinator, fn: Callable[[], Any]) -> None:
    """fn() on the writer, then agreement (so that every process raises the writer's error)."""
    co.run(fn)
    co.agree()
