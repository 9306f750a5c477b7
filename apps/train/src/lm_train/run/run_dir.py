"""The run directory: config.yaml, metrics.jsonl, checkpoints/ and hf/ of one run."""

from __future__ import annotations

import hashlib
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lm_train.config.schema import TrainLmConfig
from shard_cache import get_fs, join, read_bytes, write_atomic

RUN_FILES = ("config.yaml", "tokenizer.json")
"""What a checkpoint needs beside it to be evaluated, sampled or exported: its run's config and tokenizer."""


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
    def of_checkpoint(checkpoint: str | Path) -> RunPaths:
        """The run a checkpoint belongs to: its run directory (runs/<id>/checkpoints/step-N), or the run files
        kept beside it in its checkpoint root (trainer.checkpointer.base_path, a bucket too); a clear error if
        neither is there."""
        text = str(checkpoint).rstrip("/")
        if "://" not in text:
            step_dir = Path(text).resolve()
            for candidate in (step_dir.parent.parent, step_dir.parent):
                if (candidate / "config.yaml").exists():
                    return RunPaths(candidate)
        else:
            fs, root = get_fs(text.rpartition("/")[0])
            if fs.exists(join(root, "config.yaml")):
                local = Path(tempfile.mkdtemp(prefix="lm-train-run-of-checkpoint-"))
                for name in RUN_FILES:
                    (local / name).write_bytes(read_bytes(fs, join(root, name)))
                if fs.exists(join(root, CONFIG_CHECKSUM)):
                    (local / CONFIG_CHECKSUM).write_bytes(read_bytes(fs, join(root, CONFIG_CHECKSUM)))
                return RunPaths(local)
        from lm_train.errors import CheckpointError

        raise CheckpointError(
            f"{checkpoint} is neither inside a run directory nor beside its run's config.yaml. Pass a checkpoint "
            "written by `lm-train run`: runs/<id>/checkpoints/step-N, or <trainer.checkpointer.base_path>/step-N."
        )

    @staticmethod
    def describe_checkpoint_root(root: str, config_text: str, tokenizer: bytes) -> None:
        """Write the run files beside checkpoints kept outside the run directory (a bucket, say), so that the
        checkpoints alone serve eval, sample and export-hf wherever the run directory went."""
        write_run_files(root, config_text, tokenizer)

    def check_can_create(self) -> None:
        """A ConfigError naming trainer.run_dir when a file stands where the run directory or a parent of it goes."""
        from lm_train.errors import ConfigError

        for path in [self.run_dir, *self.run_dir.parents]:
            if not (path.exists() or path.is_symlink()):
                continue
            if not path.is_dir():
                raise ConfigError(
                    f"trainer.run_dir: {self.run_dir} cannot be made: {path} is a file, not a folder. Set "
                    "trainer.run_dir (or trainer.id) to another place, or move that file away."
                )
            return

    def create(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)  # checkpoints/ appears with the first checkpoint


CONFIG_CHECKSUM = "config.yaml.sha256"


def write_run_files(base_url: str, config_text: str, tokenizer: bytes) -> None:
    """config.yaml (with its sha256 beside it) and tokenizer.json, each replaced whole or not at all."""
    from lm_train.errors import UserError
    from shard_cache import ShardCacheError

    fs, base = get_fs(base_url)
    config = config_text.encode("utf-8")
    try:
        # The checksum goes last: a config.yaml without a matching one is refused, never half-trusted.
        write_atomic(fs, join(base, "config.yaml"), config)
        write_atomic(fs, join(base, "tokenizer.json"), tokenizer)
        write_atomic(fs, join(base, CONFIG_CHECKSUM), hashlib.sha256(config).hexdigest().encode("ascii"))
    except ShardCacheError as e:
        raise UserError(
            f"{e} (The run files already in {base_url} are whole: each is replaced in one step, or not at all.)"
        ) from None


def read_run_config(paths: RunPaths) -> Path:
    """The run's config.yaml, once its bytes match the sha256 written beside it (runs before it have none)."""
    from lm_train.errors import CheckpointError

    file, recorded_file = paths.config_file, paths.run_dir / CONFIG_CHECKSUM
    fix = (
        f"Put the config the run was started with in its place and delete {recorded_file} (rerunning `lm-train run` "
        "with that config writes both again)."
    )
    try:
        data = file.read_bytes()
        recorded = recorded_file.read_text(encoding="ascii").strip() if recorded_file.exists() else None
    except OSError as e:
        raise CheckpointError(f"Reading {e.filename} failed: {e.strerror}. Give this user access to it.") from None
    if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
        raise CheckpointError(
            f"{file} is damaged: its sha256 differs from the one recorded in {recorded_file} when it was written "
            f"(truncated, or a changed byte). {fix}"
        )
    return file
