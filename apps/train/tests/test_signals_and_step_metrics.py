"""The stop request caught from real signals, and the step-metrics logger's throughput figures."""

from __future__ import annotations

import os
import signal
import time

import jax.numpy as jnp
import pytest

from lm_train.run.signals import StopRequest
from lm_train.run.step_metrics import StepMetricsLogger


def test_sigterm_asks_to_stop_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest(process_count=1)
    try:
        assert not stop.requested(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested(2)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


class _Recorder:
    def __init__(self):
        self.logged, self.shown = [], []

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def metrics(self, step, loss, tps, mfu, seconds_per_step, learning_rate=None, grad_norm=None):
        self.shown.append((step, loss, tps, mfu, seconds_per_step))


def test_logger_reports_tokens_per_second_and_mfu_over_its_window():
    recorder = _Recorder()
    logger = StepMetricsLogger(recorder, recorder, tokens_per_step=100, flops_per_token=10.0, peak_flops=1e6)
    for _ in range(4):
        logger.step_done()
    time.sleep(0.2)
    values = logger.log(4, {"train/loss": jnp.asarray(2.5)})
    step, logged = recorder.logged[0]
    assert step == 4 and logged["train/loss"] == 2.5
    tps = logged["throughput/tokens_per_second"]
    assert 0 < tps <= 400 / 0.2
    assert logged["throughput/mfu"] == pytest.approx(tps * 10.0 / 1e6)
    assert recorder.shown[0][0] == 4 and values == logged
    logger.step_done()
    logger.log(5, {"train/loss": jnp.asarray(1.0)})
    assert recorder.logged[1][1]["throughput/tokens_per_second"] > tps  # a new window: one step, no sleep
