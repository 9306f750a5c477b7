"""`lm-train plot`: one matplotlib figure of runs' metrics.jsonl (loss, eval losses, lr, grad norm, throughput)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_train.errors import DataError, UserError, import_extra
from lm_train.tools.output_files import check_output_file, make_output_folder

EVAL_KEY = re.compile(r"^eval/(?:(?P<source>.+)/)?loss$")


@dataclass(frozen=True)
class Panel:
    """One axes of the figure: a name for --metrics, a title, and the y label."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...] = ()


PANELS = (
    Panel("loss", "Train loss", "loss (nats/token)", ("train/loss",)),
    Panel("eval", "Eval loss", "loss (nats/token)"),
    Panel("lr", "Learning rate", "learning rate", ("optim/learning_rate",)),
    Panel("grad_norm", "Gradient norm", "global L2 norm", ("optim/grad_norm",)),
    Panel("tokens_per_second", "Throughput", "tokens/s", ("throughput/tokens_per_second",)),
    Panel("mfu", "MFU", "MFU (%)", ("throughput/mfu",)),
)
PANEL_NAMES = tuple(p.name for p in PANELS)


@dataclass
class RunMetrics:
    """The logged metrics of one run: for each key, its (step, value) pairs in step order."""

    name: str
    run_dir: Path
    tokens_before: Callable[[int], int] | None
    """steps done -> the tokens trained in them (None: the run's config.yaml does not say)."""
    series: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    def eval_keys(self) -> list[str]:
        """`eval/loss` first, then `eval/<source>/loss` by name."""
        keys = [k for k in self.series if EVAL_KEY.match(k)]
        return sorted(keys, key=lambda k: (k != "eval/loss", k))


def _tokens_before(run_dir: Path) -> Callable[[int], int] | None:
    """Tokens trained by each number of steps, from train_batch_size (a size or a schedule) and seq_len in the
    run's config.yaml, or None when it cannot be read."""
    import yaml

    import shard_cache

    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
        size, seq_len = config["trainer"]["train_batch_size"], int(config["model"]["seq_len"])
        stages = [(0, int(size))] if not isinstance(size, list) else [(s["start"], s["value"]) for s in size]
        schedule = shard_cache.BatchSchedule(stages)
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None
    return lambda steps: schedule.offset(steps) * seq_len


def read_run(run_dir: str | Path) -> RunMetrics:
    """A run's metrics.jsonl; a torn last line (a run still writing) is skipped, a bad line elsewhere is an error."""
    run_dir = Path(run_dir)
    path = run_dir if run_dir.suffix == ".jsonl" else run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(
            f"{path} does not exist: give a run directory written by `lm-train run` (it holds metrics.jsonl), "
            "e.g. runs/gpt2_nano."
        )
    run_dir = path.parent
    lines = path.read_text(encoding="utf-8").split("\n")
    values: dict[str, dict[int, float]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as e:
            if number == len(lines):  # the last line, not yet ended by a newline: still being written
                continue
            raise DataError(
                f"{path}, line {number}: not a metrics record ({e}). Each line must be a JSON object with a "
                '"step"; remove or repair that line.'
            ) from None
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                values.setdefault(key, {})[step] = float(value)  # a step logged twice: its last value
    run = RunMetrics(run_dir.name, run_dir, _tokens_before(run_dir))
    for key, by_step in values.items():
        steps = sorted(by_step)
        run.series[key] = (steps, [by_step[s] for s in steps])
    return run


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average, debiased at the start (TensorBoard's smoothing); NaNs are skipped."""
    out, average, total = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            average = weight * average + (1 - weight) * value
            total = weight * total + (1 - weight)
        out.append(average / total if total else math.nan)
    return out


def _panels(names: Sequence[str] | None, runs: Sequence[RunMetrics]) -> list[Panel]:
    """The panels asked for (names, or metric keys as panels of their own); by default those with data."""
    chosen = []
    for name in names or PANEL_NAMES:
        panel = next((p for p in PANELS if p.name == name), None)
        if panel is None and "/" in name:
            panel = Panel(name, name, name.rsplit("/", 1)[-1], (name,))
        if panel is None:
            raise UserError(
                f"--metrics: unknown panel {name!r}. Use some of {', '.join(PANEL_NAMES)}, or metric keys as "
                "logged in metrics.jsonl (e.g. optim/grad_norm)."
            )
        chosen.append(panel)
    with_data = [p for p in chosen if any(_has_data(p, r) for r in runs)]
    if not with_data:
        keys = sorted({k for r in runs for k in r.series})
        raise DataError(
            f"No metric to plot: {', '.join(str(r.run_dir) for r in runs)} logged none of the panels asked for "
            f"(logged keys: {', '.join(keys) or 'none yet'}). Wait for the first log step, or pick other --metrics."
        )
    return with_data


def _has_data(panel: Panel, run: RunMetrics) -> bool:
    return bool(run.eval_keys()) if panel.name == "eval" else any(k in run.series for k in panel.keys)


def _x(run: RunMetrics, steps: list[int], axis: str) -> list[float]:
    if axis == "steps":
        return [float(s) for s in steps]
    assert run.tokens_before is not None  # checked in draw_figure
    return [float(run.tokens_before(s)) for s in steps]


def _line(ax: Any, run: RunMetrics, key: str, kind: str, x: list[float], y: list[float], **style: Any) -> None:
    (line,) = ax.plot(x, y, **style)
    line.set_gid(f"{run.name}|{key}|{kind}")  # lets tests (and users) find a series by run, key and kind


def _draw_panel(ax: Any, panel: Panel, runs: Sequence[RunMetrics], colors: list[str], x_axis: str, weight: float):
    linestyles = ("-", "--", ":", "-.")
    for run, color in zip(runs, colors, strict=True):
        if panel.name == "eval":
            for i, key in enumerate(run.eval_keys()):
                steps, values = run.series[key]
                matched = EVAL_KEY.match(key)
                assert matched is not None  # eval_keys holds only the keys that EVAL_KEY matches
                source = matched.group("source") or "all"
                label = f"{run.name}: {source}" if len(runs) > 1 else source
                style = {"color": color, "linestyle": linestyles[i % 4], "marker": "o", "markersize": 3}
                _line(ax, run, key, "raw", _x(run, steps, x_axis), values, label=label, **style)
            continue
        for key in panel.keys:
            if key not in run.series:
                continue
            steps, values = run.series[key]
            x = _x(run, steps, x_axis)
            if key == "throughput/mfu":
                values = [100 * v for v in values]
            if panel.name == "loss":
                _line(ax, run, key, "raw", x, values, color=color, alpha=0.3, linewidth=1)
                _line(ax, run, key, "smoothed", x, smooth(values, weight), color=color, linewidth=1.8)
            else:
                _line(ax, run, key, "raw", x, values, color=color, linewidth=1.5)
    ax.set_title(panel.title, fontsize=11)
    ax.set_ylabel(panel.ylabel)
    ax.set_xlabel("step" if x_axis == "steps" else "tokens")
    ax.grid(True, alpha=0.3)
    if panel.name == "eval" and any(len(r.eval_keys()) > 1 for r in runs):
        ax.legend(fontsize=8, loc="best")
    if panel.name == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))


def draw_figure(
    runs: Sequence[RunMetrics], *, metrics: Sequence[str] | None = None, x_axis: str = "steps", smoothing: float = 0.9
) -> Any:
    """A matplotlib Figure with one panel per metric group and every run overlaid (one colour per run)."""
    import_extra("matplotlib", "plot", "`lm-train plot`")
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and none is looked for
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    if x_axis not in ("steps", "tokens"):
        raise UserError(f"--x must be steps or tokens, got {x_axis!r}.")
    if not 0 <= smoothing < 1:
        raise UserError(f"--smoothing must be in [0, 1), got {smoothing}.")
    if x_axis == "tokens":
        unknown = [str(r.run_dir) for r in runs if r.tokens_before is None]
        if unknown:
            raise DataError(
                f"--x tokens needs trainer.train_batch_size and model.seq_len from config.yaml, which "
                f"{', '.join(unknown)} lacks; plot with --x steps."
            )
    panels = _panels(metrics, runs)
    columns = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6.2 * columns, 3.3 * rows + 0.6), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = [cycle[i % len(cycle)] for i in range(len(runs))]
    for ax, panel in zip(axes, panels, strict=False):
        _draw_panel(ax, panel, runs, colors, x_axis, smoothing)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=c, linewidth=2, label=r.name) for r, c in zip(runs, colors, strict=True)]
    if "loss" in {p.name for p in panels}:
        handles += [
            Line2D([], [], color="grey", alpha=0.3, label="train loss, raw"),
            Line2D([], [], color="grey", linewidth=1.8, label=f"train loss, smoothed ({smoothing:g})"),
        ]
    figure.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 4), fontsize=9)
    return figure


def plot_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    *,
    metrics: Sequence[str] | None = None,
    x_axis: str = "steps",
    smoothing: float = 0.9,
) -> Path:
    """Draw the runs' metrics into `out` (.png, .svg or .pdf); returns the path written."""
    out = Path(out)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--out {out}: write a .png, .svg or .pdf file.")
    if not run_dirs:
        raise UserError("Give at least one run directory, e.g. `lm-train plot runs/gpt2_nano`.")
    check_output_file(out, "--out")
    runs = [read_run(d) for d in run_dirs]
    if len({r.name for r in runs}) < len(runs):  # runs/a/x and runs/b/x: name them by their paths
        for run in runs:
            run.name = str(run.run_dir)
    figure = draw_figure(runs, metrics=metrics, x_axis=x_axis, smoothing=smoothing)
    make_output_folder(out, "--out")
    partial = out.with_name(f".{out.name}.partial")
    figure.savefig(partial, dpi=110, format=out.suffix.lower()[1:])
    partial.replace(out)  # a reader never sees half a file
    return out
