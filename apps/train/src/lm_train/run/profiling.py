"""`trainer.profiler`: a jax.profiler trace of some train steps, into the run directory, from the host only.

Nothing changes in the compiled step: the trace starts before the first traced step is dispatched and stops
once the last one has finished (the one wait for the device that profiling adds), and each traced step is
annotated so that Perfetto and TensorBoard's profile plugin show step boundaries.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

import trackers
from lm_train.config.watching_config import ProfilerConfig

logger = logging.getLogger(__name__)


class StepProfiler:
    """Starts a trace before step `first` and stops it after step `first + count - 1` (0-based steps)."""

    def __init__(
        self,
        config: ProfilerConfig,
        trace_dir: Path,
        *,
        tracker: trackers.Tracker | None,
        note: Callable[[str], None],
    ):
        self.first, self.stop = config.first_step, config.first_step + config.steps
        self.trace_dir = trace_dir
        self.perfetto_link = config.perfetto_link
        self.tracker = tracker
        self.note = note
        self._annotation: contextlib.AbstractContextManager | None = None
        self.tracing = False
        self.done = False

    @staticmethod
    def for_run(config: ProfilerConfig, run_dir: Path, process: tuple[int, int], tracker: trackers.Tracker, note):
        """The run's profiler, or None when trainer.profiler is off (the loop then does nothing for it)."""
        if not config.active:
            return None
        index, count = process
        trace_dir = run_dir / "profile" if count == 1 else run_dir / "profile" / f"process-{index}"
        return StepProfiler(
            config, trace_dir, tracker=tracker if index == 0 else None, note=note if index == 0 else (lambda _: None)
        )

    def before_step(self, step: int) -> None:
        """Start the trace when `step` is the first traced one (or a resumed run starts inside the window)."""
        if not self.tracing and not self.done and self.first <= step < self.stop:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            # With perfetto_link, jax's stop_trace serves the trace and waits until its link is opened.
            jax.profiler.start_trace(
                str(self.trace_dir), create_perfetto_trace=True, create_perfetto_link=self.perfetto_link
            )
            self.tracing = True
        if self.tracing:
            self._annotation = jax.profiler.StepTraceAnnotation("train_step", step_num=step)
            self._annotation.__enter__()

    def after_step(self, step: int, state: Any) -> None:
        """Close the step's annotation; after the last traced step, wait for it and write the trace."""
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self.tracing and step == self.stop - 1:
            jax.block_until_ready(state)  # the trace must hold the device work of the last step
            self._finish()

    def close(self) -> None:
        """Write a trace that is still open (the run stopped inside the window)."""
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self.tracing:
            self._finish()

    def _finish(self) -> None:
        jax.profiler.stop_trace()
        self.tracing, self.done = False, True
        trace = self.perfetto_trace()
        where = trace if trace is not None else self.trace_dir
        self.note(
            f"profile of steps {self.first}-{self.stop - 1} written to {where}\n"
            f"  open it: https://ui.perfetto.dev (Open trace file: {where}), or "
            f"`uvx --from tensorboard-plugin-profile tensorboard --logdir {self.trace_dir}` (Profile tab)"
        )
        if self.tracker is not None:
            try:
                self.tracker.log_artifact(
                    self.trace_dir, name=f"profile-steps-{self.first}-{self.stop - 1}", type="jax_profile"
                )
            except Exception as e:  # an upload problem must not end a run whose trace is safe on disk
                logger.warning("could not log the profile as an artifact: %s", e)

    def perfetto_trace(self) -> Path | None:
        """The newest perfetto_trace.json.gz under the trace directory."""
        found = sorted(self.trace_dir.glob("plugins/profile/*/perfetto_trace.json.gz"))
        return found[-1] if found else None
