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
    def tokenizer_file(self) -> Path:
        return self.run_dir / "tokenizer.json"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def hf(self) -> Path:
        return self.run_dir / "hf"

    @staticmethod
    def of_checkpoint(checkpoint: Path) -> RunPaths:
        """The run a checkpoint (runs/<id>/checkpoints/step-N) belongs to; a clear error if it is not in one."""
        run_dir = Path(checkpoint).resolve().parent.parent
        paths = RunPaths(run_dir)
        if not paths.config_file.exists():
            from lm_train.errors import CheckpointError

            raise CheckpointError(
                f"{checkpoint} is not inside a run directory (no {paths.config_file}). Pass a checkpoint "
                "written by `lm-train run`, such as runs/<id>/checkpoints/step-N."
            )
        return paths

    def create(self) -> None:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
