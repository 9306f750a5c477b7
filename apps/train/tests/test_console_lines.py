"""The console's lines on their own: numbers without exponents, lines cut to a width by rank, the step line."""

from __future__ import annotations

import re

import numpy as np
import pytest
from rich.cells import cell_len

from lm_train.run.console import fit_parts
from lm_train.run.progress import TrainingProgress, plain_number, step_parts, tokens_per_second_text
from lm_train.run.summary import short_number


@pytest.mark.parametrize("value", [3e-3, 3e-4, 6e-5, 1.234567e-4, 0.5608, 1.0, 12.345, 4567.8, 2.5e-7])
def test_plain_numbers_have_three_significant_digits_and_no_exponent(value):
    text = plain_number(value)
    assert "e" not in text.lower()
    assert float(text) == float(f"{value:.3g}")  # Python's own rounding to 3 significant digits


def test_counts_read_at_a_glance():
    assert [tokens_per_second_text(v) for v in (950.4, 3257.2, 12_345.0, 1_234_567.0)] == [
        "950",
        "3,257",
        "12.3k",
        "1.23M",
    ]
    assert [short_number(v) for v in (950, 38_816, 124_439_808, 6_738_415_616)] == ["950", "38.8k", "124M", "6.74B"]


def test_a_line_is_cut_to_its_width_leaving_out_the_highest_ranks_first():
    parts = step_parts(130, 400, 4.56281, learning_rate=3e-4, grad_norm=0.5608, tokens_per_second=3257, mfu=0.121)
    parts += [("ETA 2m41s", 1)]
    full = "step 130/400  loss 4.5628  lr 0.0003  grad norm 0.561  3,257 tok/s  MFU 12.1%  ETA 2m41s"
    assert fit_parts(parts, 200) == full
    assert fit_parts(parts, 79) == "step 130/400  loss 4.5628  lr 0.0003  grad norm 0.561  3,257 tok/s  ETA 2m41s"
    assert fit_parts(parts, 65) == "step 130/400  loss 4.5628  lr 0.0003  3,257 tok/s  ETA 2m41s"
    assert fit_parts(parts, 40) == "step 130/400  loss 4.5628  ETA 2m41s"
    for width in range(5, 120):
        line = fit_parts(parts, width)
        assert cell_len(line) <= width, (width, line)
        assert line.startswith("step 130/400"[: width - 1])
    assert fit_parts([("a very long description of what runs", 0)], 10) == "a very lo…"


def test_without_a_terminal_each_logged_step_is_one_plain_line_with_every_figure(capsys):
    with TrainingProgress(total_steps=400, start_step=0) as bar:
        bar.metrics(10, 5.123456, 3257.0, 0.121, 0.5, learning_rate=3e-4, grad_norm=1.2345)
        bar.evaluated(10, {"eval/loss": 4.98765, "eval/other": 1.0})
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "step 10/400  loss 5.1235  lr 0.0003  grad norm 1.23  3,257 tok/s  MFU 12.1%  ETA 3m15s",
        "step 10/400  eval/loss 4.9877",
    ]
    assert not [line for line in lines if re.search(r"\x1b|\d[eE][+-]?\d", line)]
    assert np.isclose(float(lines[0].split("loss ")[1].split()[0]), 5.123456, atol=5e-5)
