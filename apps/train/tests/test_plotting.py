"""`lm-train plot`: the figure's series are the values of metrics.jsonl, read back from matplotlib's lines."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from lm_train.errors import DataError, UserError
from lm_train.tools.plotting import draw_figure, plot_runs, read_run, smooth


def write_run(
    run_dir: Path, records: list[dict], *, torn_tail: str = "", batch: int | str = 8, seq_len: int = 32
) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"trainer:\n  train_batch_size: {batch}\nmodel:\n  seq_len: {seq_len}\n")
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(lines + torn_tail, encoding="utf-8")
    return run_dir


def train_records(steps: range, scale: float) -> list[dict]:
    records = []
    for s in steps:
        records.append(
            {
                "step": s,
                "train/loss": scale * (5.0 / (1 + 0.1 * s)) + 0.01 * (s % 3),
                "optim/learning_rate": 1e-3 * min(1, s / 4),
                "optim/grad_norm": 1.0 / (1 + s),
                "throughput/tokens_per_second": 1000.0 + s,
                "throughput/mfu": 0.01 * (1 + s % 2),
            }
        )
        if s % 4 == 0:
            records.append({"step": s, "eval/loss": 4.0 - 0.1 * s, "eval/code/loss": 3.5 - 0.1 * s, "eval/x": 1})
            records.append({"step": s, "eval/prose/loss": 4.5 - 0.1 * s})
    return records


def lines_by_gid(figure) -> dict[str, tuple[list[float], list[float]]]:
    found = {}
    for ax in figure.axes:
        for line in ax.get_lines():
            if line.get_gid():
                found[line.get_gid()] = (list(line.get_xdata()), list(line.get_ydata()))
    return found


def test_figure_holds_the_jsonl_values_of_every_run(tmp_path):
    a = write_run(tmp_path / "a", train_records(range(1, 13), 1.0))
    # A run still going: its last line is half written; it plots what it has.
    b = write_run(tmp_path / "b", train_records(range(1, 7), 1.2), torn_tail='{"step": 7, "train/lo')
    out = plot_runs([a, b], tmp_path / "out" / "plot.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000

    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (1364, 1155)  # 12.4 x 10.5 inches (2 columns, 3 rows, a legend) at 110 dpi

    figure = draw_figure([read_run(a), read_run(b)])
    lines = lines_by_gid(figure)
    for run_dir in (a, b):
        # The independent reference: the file read back with json, line by line.
        records = []
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        for key in ("train/loss", "optim/learning_rate", "optim/grad_norm", "throughput/tokens_per_second"):
            expected = [(r["step"], r[key]) for r in records if key in r]
            xs, ys = lines[f"{run_dir.name}|{key}|raw"]
            assert list(zip(xs, ys, strict=True)) == expected
        xs, ys = lines[f"{run_dir.name}|throughput/mfu|raw"]
        assert xs == [r["step"] for r in records if "throughput/mfu" in r]
        assert ys == pytest.approx([100 * r["throughput/mfu"] for r in records if "throughput/mfu" in r])
        for key in ("eval/loss", "eval/code/loss", "eval/prose/loss"):
            expected = [(r["step"], r[key]) for r in records if key in r]
            assert list(zip(*lines[f"{run_dir.name}|{key}|raw"], strict=True)) == expected
        raw = [r["train/loss"] for r in records if "train/loss" in r]
        _, smoothed = lines[f"{run_dir.name}|train/loss|smoothed"]
        assert smoothed == pytest.approx(smooth(raw, 0.9))
        assert "|eval/x|" not in " ".join(lines)
    assert max(lines["b|train/loss|raw"][0]) == 6  # the torn line is not plotted
    titles = [ax.get_title() for ax in figure.axes if ax.get_visible()]
    assert titles == ["Train loss", "Eval loss", "Learning rate", "Gradient norm", "Throughput", "MFU"]
    assert all(ax.get_xlabel() == "step" and ax.get_ylabel() for ax in figure.axes if ax.get_visible())
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend[:2] == ["a", "b"]


def test_tokens_axis_metric_choice_and_svg(tmp_path):
    a = write_run(tmp_path / "a", train_records(range(1, 5), 1.0), batch=4, seq_len=16)
    figure = draw_figure([read_run(a)], metrics=["lr", "optim/grad_norm"], x_axis="tokens")
    assert [ax.get_title() for ax in figure.axes] == ["Learning rate", "optim/grad_norm"]
    xs, _ = lines_by_gid(figure)["a|optim/learning_rate|raw"]
    assert xs == [64.0, 128.0, 192.0, 256.0]
    assert figure.axes[0].get_xlabel() == "tokens"
    # A batch-size schedule: 4 examples a step, then 8 from step 2 (steps done 1-4: 4, 8, 16, 24 examples).
    b = write_run(
        tmp_path / "b",
        train_records(range(1, 5), 1.0),
        batch="[{start: 0, value: 4}, {start: 2, value: 8}]",
        seq_len=16,
    )
    xs, _ = lines_by_gid(draw_figure([read_run(b)], metrics=["lr"], x_axis="tokens"))["b|optim/learning_rate|raw"]
    assert xs == [64.0, 128.0, 256.0, 384.0]
    svg = plot_runs([a], tmp_path / "p.svg", metrics=["loss"])
    assert svg.read_text().lstrip().startswith("<?xml")


def test_smoothing_is_debiased_ema():
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, (0.25 * 1 + 0.5 * 3) / 0.75])
    assert math.isnan(smooth([math.nan], 0.9)[0])


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match=r"metrics\.jsonl does not exist"):
        read_run(tmp_path / "nothing")
    bad = write_run(tmp_path / "bad", [{"step": 1, "train/loss": 1.0}])
    with open(bad / "metrics.jsonl", "a") as f:
        f.write("not json\n" + json.dumps({"step": 2, "train/loss": 0.5}) + "\n")
    with pytest.raises(DataError, match=r"metrics.jsonl, line 2: not a metrics record"):
        read_run(bad)
    ok = write_run(tmp_path / "ok", train_records(range(1, 3), 1.0))
    with pytest.raises(UserError, match="unknown panel 'loos'"):
        draw_figure([read_run(ok)], metrics=["loos"])
    with pytest.raises(UserError, match=r"--out .*x.jpg: write a .png"):
        plot_runs([ok], tmp_path / "x.jpg")
    empty = write_run(tmp_path / "empty", [])
    with pytest.raises(DataError, match="No metric to plot"):
        plot_runs([empty], tmp_path / "e.png")


def test_missing_matplotlib_names_the_extra(tmp_path):
    run = write_run(tmp_path / "r", train_records(range(1, 3), 1.0))
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
        "sys.argv = ['lm-train', 'plot', sys.argv[1]]\n"
        "from lm_train.cli import main; main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install 'lm-train[plot]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (run / "plot.png").exists()
