"""ConsoleTracker: one concise line per step, tables for hyperparameters and summary."""

from __future__ import annotations

import io

import numpy as np
from rich.console import Console

import trackers


def _console_tracker():
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, color_system=None)
    return trackers.ConsoleTracker(console=console, precision=3), buffer


def test_one_line_per_step_with_scalars_only():
    tracker, buffer = _console_tracker()
    with tracker:
        tracker.log(
            {"train/loss": np.float32(2.34567), "tokens": 4096, "hist": trackers.Histogram.from_values([1.0])},
            step=12,
        )
        tracker.log({"optim/learning_rate": 0.000123, "note": "text is left out"}, step=13)
    assert buffer.getvalue().splitlines() == [
        "step 12  train/loss 2.35  tokens 4096",
        "step 13  optim/learning_rate 0.000123",
    ]


def test_hyperparameters_and_summary_print_as_tables():
    tracker, buffer = _console_tracker()
    tracker.log_hyperparameters({"optimizer": {"learning_rate": 0.5}, "seed": 1})
    tracker.log_summary({"eval/loss": 1.23456})
    text = buffer.getvalue()
    assert "hyperparameters" in text and "summary" in text
    assert "optimizer/learning_rate" in text and "0.5" in text
    assert "eval/loss" in text and "1.23" in text and "1.2345" not in text


def test_built_from_config():
    tracker = trackers.tracker_config_from_dict({"type": "console", "precision": 2}).build()
    assert isinstance(tracker, trackers.ConsoleTracker)
    assert tracker.precision == 2
