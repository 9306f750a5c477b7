"""Errors that the CLI shows as one clear paragraph and exit code 2, without a traceback; optional dependencies."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, flag) that they can fix."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, key, value or override is wrong."""


class DataError(UserError):
    """Training or validation data is missing or unreadable."""


class CheckpointError(UserError):
    """A checkpoint is missing, torn, or does not fit the model."""


class ExportError(UserError):
    """An export does not read back as the checkpoint it was made from."""


class MissingExtraError(UserError):
    """An optional dependency of a command is not installed."""


def import_extra(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, or raise a MissingExtraError that names the `lm-train[extra]` install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} needs the optional package {module.split('.')[0]!r}, which is not installed here "
            f"({e}). Install lm-train's `{extra}` extra: `pip install 'lm-train[{extra}]'`, or in this "
            f"workspace `uv sync --all-groups` (the dev group carries it)."
        ) from None


def require_lm_eval() -> ModuleType:
    """lm_eval, imported offline; a clear error naming the `harness` extra when it is not installed."""
    # The tasks read local files only: never let `datasets` or the hub reach for the network.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return import_extra("lm_eval", "harness", "The evaluation harness (`lm-train harness`, trainer.eval_harness)")
