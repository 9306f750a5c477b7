"""A tracker writing one JSON object per `log` call to a .jsonl file (a run's metrics.jsonl)."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trackers.histogram import Histogram
from trackers.tracker import Tracker, raise_if_finished
from trackers.values import json_number, jsonable, plain_metrics, plain_step

logger = logging.getLogger(__name__)


def _write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a crash leaves either the old or the new file, never half."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _complete_lines(path: Path, text: str) -> list[str]:
    """The newline-terminated lines of a file's text; a torn last line (a crash mid-write) is dropped."""
    lines = text.split("\n")
    torn = lines.pop()
    if torn:
        logger.warning("%s: dropping a partly written last line (%d characters)", path, len(torn))
    return lines


def _line_step(path: Path, number: int, line: str) -> int | None:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}, line {number}: not valid JSON ({error.msg}); fix or remove that line by hand "
            "before resuming (nothing was changed)."
        ) from None
    step = entry.get("step") if isinstance(entry, dict) else None
    return step if isinstance(step, int) else None


def _prepare_for_append(path: Path, resume_from_step: int | None) -> None:
    """Drop a torn last line and, when resuming, the entries at or after the resume step."""
    if not path.exists():
        return
    original = path.read_text(encoding="utf-8")
    lines = _complete_lines(path, original)
    kept = lines
    if resume_from_step is not None:
        kept = []
        for number, line in enumerate(lines, start=1):
            step = _line_step(path, number, line)
            if step is None or step < resume_from_step:
                kept.append(line)
        if len(kept) < len(lines):
            logger.info(
                "%s: resuming at step %d, dropped %d later entries",
                path,
                resume_from_step,
                len(lines) - len(kept),
            )
    new_text = "".join(f"{line}\n" for line in kept)
    if new_text != original:
        _write_atomically(path, new_text)


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object stored at `path`, or {} when there is none yet."""
    if not path.exists():
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg}); fix or delete it before starting the run.") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} should hold a JSON object, not {type(loaded).__name__}; fix or delete it.")
    return loaded


def _json_metric(value: Any) -> Any:
    if isinstance(value, Histogram):
        return jsonable(value)
    if isinstance(value, str):
        return value
    return json_number(value)


class JsonlTracker(Tracker):
    """Appends `{"step": N, name: value, ...}` lines; NaN and infinities are written as null.

    With `resume_from_step=N`, lines with step >= N are removed first, so a resumed run has no
    duplicate steps. Hyperparameters and the summary go to `<stem>.hparams.json` and
    `<stem>.summary.json` beside the file; artifacts are not recorded.
    """

    def __init__(self, path: str | Path, *, resume_from_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None:
            resume_from_step = plain_step(resume_from_step)
        _prepare_for_append(self.path, resume_from_step)
        # Open for the tracker's lifetime; finish() closes it.
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()
        self._finished = False
        # A resumed run keeps what the earlier run wrote and merges into it.
        self._hyperparameters: dict[str, Any] = _read_json_object(self.hyperparameters_path)
        self._summary: dict[str, Any] = _read_json_object(self.summary_path)

    @property
    def hyperparameters_path(self) -> Path:
        """Where `log_hyperparameters` writes."""
        return self.path.with_name(f"{self.path.stem}.hparams.json")

    @property
    def summary_path(self) -> Path:
        """Where `log_summary` writes."""
        return self.path.with_name(f"{self.path.stem}.summary.json")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append one line: the step, then each metric."""
        raise_if_finished(self, self._finished)
        entry: dict[str, Any] = {"step": plain_step(step)}
        for key, value in plain_metrics(metrics).items():
            if key == "step":
                raise ValueError("A metric may not be named 'step': that key holds the step in the file.")
            entry[key] = _json_metric(value)
        line = json.dumps(entry, allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def log_hyperparameters(self, hyperparameters: Mapping[str, Any]) -> None:
        """Merge into `<stem>.hparams.json`."""
        raise_if_finished(self, self._finished)
        with self._lock:
            self._hyperparameters.update(jsonable(hyperparameters))
            _write_atomically(self.hyperparameters_path, json.dumps(self._hyperparameters, indent=2) + "\n")

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Merge into `<stem>.summary.json`."""
        raise_if_finished(self, self._finished)
        with self._lock:
            self._summary.update(jsonable(summary))
            _write_atomically(self.summary_path, json.dumps(self._summary, indent=2) + "\n")

    def log_artifact(self, path: str | Path, name: str | None = None, type: str = "file") -> None:
        """Artifacts stay where they are; the jsonl file records metrics only."""
        raise_if_finished(self, self._finished)

    def finish(self) -> None:
        """Close the file."""
        with self._lock:
            if not self._finished:
                self._finished = True
                self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The entries of a metrics .jsonl file, in order (a torn last line is skipped)."""
    path = Path(path)
    return [json.loads(line) for line in _complete_lines(path, path.read_text(encoding="utf-8"))]
