"""The built-in corpus: the Python standard library's own source files, split by a hash of each path."""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Folders of test suites and their data: excluded so the corpus is the library itself.
_TEST_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusSplit:
    """The files of one split, sorted, so that the cache built from them is deterministic."""

    train: tuple[Path, ...]
    validation: tuple[Path, ...]


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's non-empty .py files outside test folders, sorted by relative path."""
    root = root or stdlib_root()
    files = [
        f
        for f in root.rglob("*.py")
        if not (_TEST_DIRS & set(f.relative_to(root).parts[:-1])) and f.is_file() and f.read_bytes().strip()
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def in_validation(relative_path: str, fraction: float) -> bool:
    """Whether a file belongs to the validation split: a stable hash of its path, not of the machine."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_stdlib(validation_fraction: float, root: Path | None = None) -> CorpusSplit:
    """Split the standard library's files into train and validation by path hash."""
    root = root or stdlib_root()
    train, validation = [], []
    for f in stdlib_files(root):
        rel = f.relative_to(root).as_posix()
        (validation if in_validation(rel, validation_fraction) else train).append(f)
    if not train or not validation:
        raise RuntimeError(
            f"The standard library at {root} gave {len(train)} training and {len(validation)} validation files; "
            "this Python installation looks incomplete. Point data.train_urls at your own text instead."
        )
    return CorpusSplit(tuple(train), tuple(validation))
