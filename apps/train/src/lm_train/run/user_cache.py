"""Values kept between runs in small JSON files of the user's cache folder, keyed by what they depend on."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", int, float)


def user_cache_file(name: str) -> str:
    """The file `name` of this user's lm-train cache: $XDG_CACHE_HOME (or ~/.cache)/lm-train/`name`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "lm-train", name)


def kept_or_computed(
    path: str, key: str, kind: type[T], compute: Callable[[], T], *, indent: int, max_entries: int | None = None
) -> T:
    """The `kind` value kept under `key` in the JSON file `path`, or else `compute()`'s, kept there for next time.

    A missing or damaged file counts as empty; `max_entries` keeps only the newest entries; a file that cannot be
    written (a read-only home) keeps nothing, and the value is computed each time.
    """
    try:
        with open(path, encoding="utf-8") as f:
            known = json.load(f)
        if isinstance(known.get(key), kind):
            return known[key]
    except (OSError, ValueError, AttributeError):
        known = {}
    value = compute()
    kept = known if max_entries is None else dict(list(known.items())[-(max_entries - 1) :])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"  # written whole, then renamed: a reader never sees half a file
        with open(partial, "w", encoding="utf-8") as f:
            json.dump({**kept, key: value}, f, indent=indent)
        os.replace(partial, path)
    except OSError:  # a read-only home still runs; it computes each time
        pass
    return value
