"""The few lines a run prints before it trains: model, tokens per step, mesh, data, outputs, the full config's path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from lm_train.run.preflight import RunSetup


def short_number(value: float) -> str:
    """`950`, `12.3k`, `124M`, `6.74B`: three significant digits, for counts a person reads at a glance."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            scaled = value / scale
            return f"{scaled:.3g}{suffix}" if scaled < 1000 else f"{scaled:.0f}{suffix}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"


def shown_path(path: str | os.PathLike) -> str:
    """A path relative to the working directory when it lies under it (shorter, and what the user typed)."""
    text = str(path)
    if "://" in text:
        return text
    try:
        relative = Path(text).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return text
    return str(relative) if str(relative) != "." else text


def parameter_count(model: Any) -> int:
    """How many numbers the model's arrays hold."""
    return sum(leaf.size for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))


def _model_line(setup: RunSetup, params: int) -> str:
    model = setup.config.model
    shape = [
        pattern.format(getattr(model, name))
        for name, pattern in (("num_layers", "{} layers"), ("hidden_dim", "hidden {}"), ("num_heads", "{} heads"))
        if isinstance(getattr(model, name, None), int)
    ]
    return f"{model.model_type}" + (f" ({', '.join(shape)})" if shape else "") + f", {short_number(params)} params"


def _data_line(data: Any) -> str:
    sources = getattr(data, "sources", None)
    if sources is not None:  # a mixture
        text = f"a mixture of {len(sources)}: {', '.join(sources)}"
    else:
        text = f"cache {shown_path(data.train_cache)}"
    return text + (" (building)" if data.build_metrics is not None else "")


def _outputs_line(setup: RunSetup) -> str:
    paths, config = setup.paths, setup.config
    inside = ["metrics.jsonl"]
    elsewhere = []
    for name, configured, default in (
        ("checkpoints", config.trainer.checkpointer.base_path, paths.checkpoints),
        ("hf", config.hf_save_path, paths.hf),
    ):
        if configured and shown_path(configured) != shown_path(default):
            elsewhere.append(f"{name} in {shown_path(configured)}")
        else:
            inside.append(f"{name}/")
    return f"{shown_path(paths.run_dir)}/ ({', '.join(inside)})" + "".join(f"; {e}" for e in elsewhere)


def _pipeline_line(setup: RunSetup) -> str:
    schedule = setup.step_settings.pipeline
    assert schedule is not None  # shown only for a pipelined run
    return schedule.describe().removeprefix("pipeline: ")


def _stages_text(schedule: Any) -> str:
    """A batch-size schedule in a few words: `batch 4 from step 0, 8 from step 3`."""
    return "batch " + ", ".join(
        f"{size} from step {start}" for start, size in zip(schedule.starts, schedule.sizes, strict=True)
    )


def run_summary(setup: RunSetup, data: Any, model: Any, start: int, sequences_per_example: int = 1) -> str:
    """What the run trains and where its outputs go, in a few short lines; the whole config is in config.yaml."""
    config, t, paths = setup.config, setup.config.trainer, setup.paths
    mesh = setup.plan.mesh
    devices = mesh.devices.flat[0]
    schedule = t.batch_schedule
    sequences = schedule.size_at(start) * sequences_per_example
    tokens = sequences * config.model.seq_len
    stages = "" if schedule.fixed is not None else ", " + _stages_text(schedule)
    run_dir = shown_path(paths.run_dir)
    progress = f"resuming at step {start} of {t.num_train_steps}" if start else f"{t.num_train_steps} steps"
    rows = [
        ("run", f"{run_dir} ({progress})"),
        ("model", _model_line(setup, parameter_count(model))),
        ("tokens", f"{tokens:,} per step ({sequences} sequences of {config.model.seq_len}{stages})"),
        (
            "mesh",
            f"{mesh.devices.size} {devices.platform} device{'s' * (mesh.devices.size > 1)}: "
            + " × ".join(f"{name} {size}" for name, size in mesh.shape.items()),
        ),
        ("data", _data_line(data)),
        *([("pipeline", _pipeline_line(setup))] if setup.step_settings.pipeline is not None else []),
        ("outputs", _outputs_line(setup)),
        ("config", f"{shown_path(paths.config_file)} (the whole resolved config)"),
    ]
    return "\n".join(f"{key:<8} {value}" for key, value in rows)


__all__ = ["parameter_count", "run_summary", "short_number", "shown_path"]
