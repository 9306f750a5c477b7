"""The run directory: config.yaml, metrics.jsonl, checkpoints/ and hf/ of one run."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lm_train.config.schema import TrainLmConfig


@dataclass(frozen=True)
class RunPaths:
    """Where a run writes; one directory per run, as the design's contract says."""

    run_dir: Path

    @staticmethod
    def for_config(config: TrainLmConfig, config_files: Sequence[Path] = ()) -> RunPaths:
        """`trainer.run_dir`, else runs/<trainer.id>, else runs/<stem of the first config file>."""
        if config.trainer.run_dir:
            return RunPaths(Path(config.trainer.run_dir))
        name = config.trainer.id or (Path(config_files[0]).stem if config_files else "run")
        return RunPaths(Path("runs") / re.sub(r"[^\w.-]+", "_", name))

    @property
    def config_file(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def metrics_file(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def hf(self) -> Path:
        return self.run_dir / "hf"

    def create(self) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
