"""A prepared launch: the validated config, the run id, the shipped folder and the environment of every process.

Any backend (Ray today; SLURM and TPU VMs later) starts `lm-train run` from one of these on each host; it decides
nothing about the run itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_train.config.schema import LaunchRecord
from lm_train.errors import ConfigError
from lm_train.launch.snapshot import Snapshot, checkout_of, take_snapshot, warn_if_dirty

PASSED_PREFIXES = ("LM_TRAIN_", "JAX_", "WANDB_", "AWS_", "HF_")
PASSED_NAMES = ("XLA_FLAGS", "STORAGE_EMULATOR_HOST")
LAUNCHER_SETS = ("LM_TRAIN_COORDINATOR_ADDRESS", "LM_TRAIN_NUM_PROCESSES", "LM_TRAIN_PROCESS_ID")
"""Set per process by the launcher: the caller's own values (from a run of its own) never reach the hosts."""
LOCAL_SETS = ("LM_TRAIN_LOCAL_PROCESS_ID", "LM_TRAIN_LOCAL_PROCESS_COUNT")
"""Set per process too, always (with --tasks-per-node): a process's index on its host, and how many its host runs."""

CONFIG_NAME = "lm-train-launch/config.yaml"
"""Where the resolved config lies in the shipped folder."""
RUN_ID_FILE = "run-id"
"""The generated run id, kept in the run directory so that every later launch of the same config reuses it."""


@dataclass(frozen=True)
class PreparedLaunch:
    """Everything a backend needs to start the same training on every host."""

    run_id: str
    run_dir: Path
    workdir: Path
    """The local folder every host gets: the source snapshot plus the resolved config (CONFIG_NAME)."""
    source_dirs: tuple[str, ...]
    """src folders inside workdir that go first on PYTHONPATH, so that the shipped code is the code that runs."""
    env: dict[str, str]
    """The caller's environment that configures a run (PASSED_PREFIXES, PASSED_NAMES)."""
    cwd: str
    """The caller's working directory: relative paths of the config mean what they mean to `lm-train run` there."""
    record: LaunchRecord
    run_id_is_new: bool = False

    def argv(self, python: str, workdir: str) -> list[str]:
        """The command of each process, with the shipped folder unpacked at `workdir` on its host."""
        return [python, "-m", "lm_train", "run", str(Path(workdir) / CONFIG_NAME)]

    def process_env(
        self, workdir: str, process_id: int, num_processes: int, coordinator: str, local: tuple[int, int] = (0, 1)
    ) -> dict[str, str]:
        """The variables a backend adds to a host's own environment for process `process_id`, the `local[0]`-th of
        the `local[1]` processes of its host."""
        shipped = [str(Path(workdir) / d) for d in self.source_dirs]
        return {
            **self.env,
            "LM_TRAIN_COORDINATOR_ADDRESS": coordinator,
            "LM_TRAIN_NUM_PROCESSES": str(num_processes),
            "LM_TRAIN_PROCESS_ID": str(process_id),
            "LM_TRAIN_LOCAL_PROCESS_ID": str(local[0]),
            "LM_TRAIN_LOCAL_PROCESS_COUNT": str(local[1]),
            "PYTHONPATH": os.pathsep.join(shipped),
        }

    def process_cwd(self, workdir: str) -> str:
        """The caller's directory where the host has it (a shared file system), else the shipped folder."""
        return self.cwd if os.path.isdir(self.cwd) else workdir

    def claim_run_id(self) -> None:
        """Write a generated run id into the run directory (once the launch is sure to start)."""
        if self.run_id_is_new:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / RUN_ID_FILE).write_text(self.run_id + "\n", encoding="utf-8")


def passed_env(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """The caller's variables that configure a run, without the ones the launcher sets per process."""
    return {
        k: v
        for k, v in environ.items()
        if (k.startswith(PASSED_PREFIXES) or k in PASSED_NAMES) and k not in LAUNCHER_SETS + LOCAL_SETS
    }


def _run_id(config: Any, run_dir: Path, stem: str) -> tuple[str, bool]:
    """trainer.id, else the id an earlier launch wrote into the run directory, else a new one."""
    if config.trainer.id:
        return config.trainer.id, False
    written = run_dir / RUN_ID_FILE
    if written.is_file() and written.read_text(encoding="utf-8").strip():
        return written.read_text(encoding="utf-8").strip(), False
    name = re.sub(r"[^\w.-]+", "_", stem)
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}", True


def prepare_launch(
    config: Any, files: list[Path], backend: str, *, source: Path | None = None, require_clean: bool = False
) -> PreparedLaunch:
    """Check what a launch needs of the config, snapshot the checkout and write the resolved config to ship.

    `source`: the checkout to ship (default: the one lm_train is imported from; none when it is installed).
    Nothing is written into the run directory here."""
    from lm_train.config.loading import dump_config
    from lm_train.run.run_dir import RunPaths

    if config.trainer.load_checkpoint is False:
        raise ConfigError(
            "trainer.load_checkpoint: false would make every restart of a launched run start again from step 0. "
            "Remove the key (a launched run resumes from its newest intact checkpoint), or give a new trainer.id "
            "to start a new run."
        )
    run_dir = RunPaths.for_config(config, files).run_dir.absolute()
    run_id, is_new = _run_id(config, run_dir, files[0].stem if files else "run")
    workdir = Path(tempfile.mkdtemp(prefix="lm-train-launch-"))
    try:
        root = source if source is not None else checkout_of(Path(__file__).resolve().parent)
        snapshot: Snapshot | None = None
        if root is not None:
            snapshot = take_snapshot(root, workdir, require_clean=require_clean)
            warning = warn_if_dirty(snapshot)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        record = LaunchRecord(
            backend=backend,
            commit=snapshot.commit if snapshot else None,
            diff_sha256=snapshot.diff_sha256 if snapshot else None,
            dirty_files=snapshot.dirty_files if snapshot else (),
        )
        trainer = dataclasses.replace(config.trainer, id=run_id, run_dir=str(run_dir))
        launched = dataclasses.replace(config, trainer=trainer, launch=record)
        (workdir / CONFIG_NAME).parent.mkdir(parents=True, exist_ok=True)
        (workdir / CONFIG_NAME).write_text(dump_config(launched), encoding="utf-8")
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)  # a refused launch leaves nothing behind
        raise
    return PreparedLaunch(
        run_id=run_id,
        run_dir=run_dir,
        workdir=workdir,
        source_dirs=tuple(snapshot.source_dirs()) if snapshot else (),
        env=passed_env(os.environ),
        cwd=os.getcwd(),
        record=record,
        run_id_is_new=is_new,
    )
