"""Import an optional backend library, or say which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_extra(module: str, extra: str) -> ModuleType:
    """Import `module`, raising an ImportError that names the `trackers[extra]` install when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"The {extra} tracker needs the {module!r} package, which is not installed. "
            f"Install it with `pip install 'trackers[{extra}]'` (or `uv add 'trackers[{extra}]'`)."
        ) from error
