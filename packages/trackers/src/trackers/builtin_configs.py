"""The built-in tracker configs: wandb, tensorboard, jsonl, console, noop."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from trackers.config_registry import TrackerConfig, register_tracker_config
from trackers.tracker import Tracker


def _per_process(path: Path, process_index: int) -> Path:
    """Process 0 keeps the configured name; others (with all_processes) get '.process-N' before the suffix."""
    if process_index == 0:
        return path
    return path.with_name(f"{path.stem}.process-{process_index}{path.suffix}")


@register_tracker_config("wandb")
@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbConfig(TrackerConfig):
    """Weights & Biases; keys as in Levanter. `dir` (default: the run directory) holds wandb's files."""

    project: str | None = None
    entity: str | None = None
    name: str | None = None
    tags: tuple[str, ...] = ()
    group: str | None = None
    notes: str | None = None
    id: str | None = None
    resume: bool | Literal["allow", "must", "never", "auto"] | None = None
    mode: Literal["online", "offline", "disabled"] | None = None
    save_code: bool = True
    dir: str | None = None

    def check_ready(self) -> None:
        """Refuse an online run for which wandb finds no API key (wandb.init would raise UsageError)."""
        from trackers.config_registry import TrackerConfigError
        from trackers.wandb_tracker import missing_credentials

        problem = missing_credentials(self.mode)
        if problem is not None:
            raise TrackerConfigError(
                f"wandb would log online, but {problem}, so `wandb.init` would stop the run. Log in with `wandb "
                "login` (or set WANDB_API_KEY); or keep the run on this machine for a later `wandb sync`: set "
                "WANDB_MODE=offline in the environment, or `mode: offline` in the tracker section (`mode: disabled` "
                "turns wandb off)."
            )

    def _build(self, run_dir: Path, process_index: int, resume_from_step: int | None) -> Tracker:
        from trackers.wandb_tracker import WandbTracker

        return WandbTracker(
            project=self.project,
            entity=self.entity,
            name=self.name,
            tags=self.tags,
            group=self.group,
            notes=self.notes,
            id=self.id,
            resume=self.resume,
            mode=self.mode,
            save_code=self.save_code,
            dir=run_dir / self.dir if self.dir is not None else run_dir,
        )


@register_tracker_config("tensorboard")
@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorboardConfig(TrackerConfig):
    """TensorBoard event files in `logdir` (relative to the run directory)."""

    logdir: str = "tensorboard"
    flush_secs: int = 10

    def _build(self, run_dir: Path, process_index: int, resume_from_step: int | None) -> Tracker:
        from trackers.tensorboard_tracker import TensorboardTracker

        logdir = run_dir / self.logdir
        if process_index != 0:
            logdir = logdir / f"process-{process_index}"
        return TensorboardTracker(logdir, purge_step=resume_from_step, flush_secs=self.flush_secs)


@register_tracker_config("jsonl")
@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonlConfig(TrackerConfig):
    """One JSON object per log call in `path` (relative to the run directory)."""

    path: str = "metrics.jsonl"

    def _build(self, run_dir: Path, process_index: int, resume_from_step: int | None) -> Tracker:
        from trackers.jsonl import JsonlTracker

        path = _per_process(run_dir / self.path, process_index)
        return JsonlTracker(path, resume_from_step=resume_from_step)


@register_tracker_config("console")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ConsoleConfig(TrackerConfig):
    """A line per logged step on the terminal; floats with `precision` significant digits."""

    precision: int = 4

    def _build(self, run_dir: Path, process_index: int, resume_from_step: int | None) -> Tracker:
        from trackers.console import ConsoleTracker

        return ConsoleTracker(precision=self.precision)


@register_tracker_config("noop")
@dataclasses.dataclass(frozen=True, kw_only=True)
class NoopConfig(TrackerConfig):
    """Records nothing."""

    def _build(self, run_dir: Path, process_index: int, resume_from_step: int | None) -> Tracker:
        from trackers.noop import NoopTracker

        return NoopTracker()
