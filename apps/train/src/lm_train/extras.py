"""Optional dependencies of lm-train (matplotlib, lm-eval): import them, or say which extra installs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from lm_train.errors import UserError


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
