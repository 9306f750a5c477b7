"""Logging the train step's metrics at the log interval: loss and optimizer figures, tokens/s and MFU."""

from __future__ import annotations

import time
from typing import Any

import jax

import trackers
from lm_train.run.progress import TrainingProgress


class StepMetricsLogger:
    """Times windows of steps and logs, at each log step, the step's metrics with the window's throughput.

    The metrics are fetched from the device only at log steps: that is the loop's one host round trip.
    """

    def __init__(
        self,
        tracker: trackers.Tracker,
        bar: TrainingProgress,
        *,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float,
    ):
        self.tracker = tracker
        self.bar = bar
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._start, self._steps, self._tokens = time.perf_counter(), 0, 0

    def step_done(self, tokens: int | None = None) -> None:
        """Count a step and its tokens (default tokens_per_step; a batch-size schedule's steps differ)."""
        self._steps += 1
        self._tokens += self.tokens_per_step if tokens is None else tokens

    def log(
        self, step: int, metrics: dict[str, Any], extra: dict[str, float] | None = None
    ) -> dict[str, float | trackers.Histogram]:
        """Fetch and log the metrics of `step` with the throughput since the last log (and `extra` host-side
        values, such as a mixture's data metrics); returns what was logged."""
        fetched = jax.device_get(metrics)
        # A histogram (a mixture's expert loads) goes to the trackers as it is; every other metric is a scalar.
        values: dict[str, float | trackers.Histogram]
        values = {k: v if isinstance(v, trackers.Histogram) else float(v) for k, v in fetched.items()}
        values.update(extra or {})
        elapsed = time.perf_counter() - self._start
        steps = max(self._steps, 1)
        tokens_per_second = self._tokens / max(elapsed, 1e-9)
        values["throughput/tokens_per_second"] = tokens_per_second
        values["throughput/mfu"] = tokens_per_second * self.flops_per_token / self.peak_flops
        self.tracker.log(values, step=step)
        scalars = {k: v for k, v in values.items() if not isinstance(v, trackers.Histogram)}
        self.bar.metrics(
            step,
            scalars["train/loss"],
            tokens_per_second,
            scalars["throughput/mfu"],
            elapsed / steps,
            learning_rate=scalars.get("optim/learning_rate"),
            grad_norm=scalars.get("optim/grad_norm"),
        )
        self._start, self._steps, self._tokens = time.perf_counter(), 0, 0
        return values
