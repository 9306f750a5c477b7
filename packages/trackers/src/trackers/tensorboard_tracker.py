"""A tracker writing TensorBoard event files with tensorboardX (no TensorFlow needed)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trackers.extras import import_extra
from trackers.histogram import Histogram
from trackers.tracker import Tracker, raise_if_finished
from trackers.values import flatten_mapping, jsonable, plain_metrics, plain_step


def _markdown_table(values: Mapping[str, Any]) -> str:
    rows = [f"| {key} | {json.dumps(value)} |" for key, value in flatten_mapping(jsonable(values)).items()]
    return "\n".join(["| key | value |", "|---|---|", *rows])


class TensorboardTracker(Tracker):
    """Scalars, histograms and text under `logdir`.

    `purge_step=N` (used when resuming) makes TensorBoard hide events at step >= N written by the run
    before, so a resumed curve has no doubled section.
    """

    def __init__(self, logdir: str | Path, *, purge_step: int | None = None, flush_secs: int = 10) -> None:
        tensorboardX = import_extra("tensorboardX", "tensorboard")
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = tensorboardX.SummaryWriter(
            logdir=str(self.logdir),
            purge_step=plain_step(purge_step) if purge_step is not None else None,
            flush_secs=flush_secs,
            # tensorboardX names files by the second: a writer started in the same second as the last
            # one would overwrite its file. Nanoseconds keep names unique and in start order.
            filename_suffix=f".{time.time_ns()}",
        )
        self._last_step = 0
        self._finished = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Scalars with add_scalar, strings with add_text, Histograms with add_histogram_raw."""
        raise_if_finished(self, self._finished)
        step = plain_step(step)
        for key, value in plain_metrics(metrics).items():
            if isinstance(value, str):
                self.writer.add_text(key, value, global_step=step)
            elif isinstance(value, Histogram):
                self.writer.add_histogram_raw(
                    key,
                    min=value.min,
                    max=value.max,
                    num=value.num,
                    sum=value.sum,
                    sum_squares=value.sum_squares,
                    bucket_limits=value.edges[1:],
                    bucket_counts=value.counts,
                    global_step=step,
                )
            else:
                self.writer.add_scalar(key, float(value), global_step=step)
        self._last_step = step

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """A markdown table under the text tag 'hyperparameters'."""
        raise_if_finished(self, self._finished)
        self.writer.add_text("hyperparameters", _markdown_table(hyperparameters), global_step=0)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """A markdown table under the text tag 'summary', at the last logged step."""
        raise_if_finished(self, self._finished)
        self.writer.add_text("summary", _markdown_table(summary), global_step=self._last_step)

    def log_artifact(self, path: str | Path, name: str | None = None, type: str = "file") -> None:
        """TensorBoard stores no files: note the artifact's place under the text tag 'artifacts/<name>'."""
        raise_if_finished(self, self._finished)
        self.writer.add_text(f"artifacts/{name or Path(path).name}", f"{type}: {path}", self._last_step)

    def flush(self) -> None:
        """Write pending events to disk now."""
        self.writer.flush()

    def finish(self) -> None:
        """Flush and close the event file."""
        if not self._finished:
            self._finished = True
            self.writer.close()
