"""A tracker writing to Weights & Biases (online, or offline with no network at all)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trackers.extras import import_extra
from trackers.histogram import Histogram
from trackers.tracker import Tracker, raise_if_finished
from trackers.values import jsonable, plain_metrics, plain_step

OFFLINE_MODES = ("offline", "dryrun", "disabled")


def missing_credentials(mode: str | None) -> str | None:
    """Why `wandb.init(mode=mode)` would stop for want of credentials here, or None: offline or disabled (by
    `mode`, else by WANDB_MODE or wandb's settings files), or an API key found as wandb.init would find it."""
    wandb = import_extra("wandb", "wandb")
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib.wbauth import authenticate
    except ImportError:  # another wandb's layout: its own wandb.init says what is missing
        return None
    settings = wandb_setup.singleton().settings  # environment and settings files, as wandb.init reads them
    if (mode or settings.mode) in OFFLINE_MODES:
        return None
    try:
        found = authenticate.authenticate_session(
            host=settings.base_url, source="trackers", prompt=False, update_session=False
        )
    except wandb.errors.AuthenticationError as error:  # a key in a form wandb rejects
        return f"its API key is not usable ({error})"
    return None if found is not None else f"no API key for {settings.base_url} is configured here"


class WandbTracker(Tracker):
    """One wandb run; arguments are those of `wandb.init` (None leaves wandb's default or environment)."""

    def __init__(
        self,
        *,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        group: str | None = None,
        notes: str | None = None,
        id: str | None = None,
        resume: bool | str | None = None,
        mode: str | None = None,
        save_code: bool | None = None,
        dir: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self._wandb = import_extra("wandb", "wandb")
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = self._wandb.init(
            project=project,
            entity=entity,
            name=name,
            tags=list(tags) or None,
            group=group,
            notes=notes,
            id=id,
            resume=resume,
            mode=mode,
            save_code=save_code,
            dir=str(dir) if dir is not None else None,
            config=jsonable(config) if config is not None else None,
        )
        self._finished = False

    def _wandb_value(self, value: Any) -> Any:
        if isinstance(value, Histogram):
            return self._wandb.Histogram(np_histogram=(value.counts, value.edges))
        return value

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """`run.log` at this step (wandb ignores steps lower than one it already saw)."""
        raise_if_finished(self, self._finished)
        values = {key: self._wandb_value(value) for key, value in plain_metrics(metrics).items()}
        self.run.log(values, step=plain_step(step))

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """Update the run's config."""
        raise_if_finished(self, self._finished)
        self.run.config.update(jsonable(hyperparameters), allow_val_change=True)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Update the run's summary."""
        raise_if_finished(self, self._finished)
        self.run.summary.update(jsonable(summary))

    def log_artifact(self, path: str | Path, name: str | None = None, type: str = "file") -> None:
        """Log a file or directory as a wandb Artifact (named after the path unless `name` is given)."""
        raise_if_finished(self, self._finished)
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"log_artifact: {path} does not exist.")
        artifact = self._wandb.Artifact(name or path.name, type=type)
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        """Finish the wandb run (writes everything out; offline runs can later be `wandb sync`ed)."""
        if not self._finished:
            self._finished = True
            self.run.finish()
            # wandb's service writes the run's .wandb file after finish() returns; tearing the service down
            # waits for that, so the file is complete when we return. Only when no other run still uses it.
            if self._wandb.run is None:
                self._wandb.teardown()
