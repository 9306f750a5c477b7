"""Where checkpoint files come from: a local directory, an fsspec URL (copied to a temporary directory), or a hub id."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from fnmatch import fnmatch
from pathlib import Path

import fsspec

from .errors import HfBridgeError
from .hub import download_snapshot, looks_like_hub_id
from .reader import refuse_unsafe_formats

CHECKPOINT_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model")


def is_url(path: str) -> bool:
    """Whether `path` is an fsspec URL with a protocol other than plain local files."""
    protocol = path.split("://", 1)[0] if "://" in path else ""
    return bool(protocol) and protocol not in ("file", "local")


def _strip_file_scheme(path: str) -> str:
    return path.split("://", 1)[1] if path.startswith(("file://", "local://")) else path


@contextlib.contextmanager
def local_copy(
    path: str | os.PathLike,
    *,
    patterns: Sequence[str] = CHECKPOINT_FILES,
    revision: str | None = None,
    what: str = "checkpoint",
) -> Iterator[Path]:
    """A local path for `path` (a directory or a file): itself, a temporary copy of a URL, or a hub snapshot."""
    text = os.fspath(path)
    if is_url(text):
        with tempfile.TemporaryDirectory(prefix="hf_bridge_") as tmp:
            yield _copy_from_url(text, Path(tmp), patterns, what)
        return
    local = Path(_strip_file_scheme(text)).expanduser()
    if local.exists():
        yield local
        return
    if looks_like_hub_id(text):
        yield download_snapshot(text, patterns, revision)
        return
    raise HfBridgeError(
        f"The {what} path {text!r} does not exist. Pass an existing local directory or file, an fsspec URL "
        "(e.g. gs://bucket/dir), or a Hugging Face Hub id."
    )


def _copy_from_url(url: str, tmp: Path, patterns: Sequence[str], what: str) -> Path:
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise HfBridgeError(f"Cannot open the {what} URL {url!r}: {e}. Install the fsspec backend it needs.") from None
    try:
        if fs.isfile(root):
            target = tmp / Path(root).name
            fs.get(root, str(target))
            return target
        if not fs.isdir(root):
            raise HfBridgeError(f"The {what} URL {url!r} does not exist (neither a file nor a directory).")
        names = []
        for entry in fs.ls(root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            names.append(name)
            if fs.isfile(entry) and any(fnmatch(name, p) for p in patterns):
                fs.get(entry, str(tmp / name))
        if not any(n.endswith(".safetensors") for n in names):
            refuse_unsafe_formats(url, names)
    except HfBridgeError:
        raise
    except OSError as e:
        raise HfBridgeError(f"Could not read the {what} at {url!r}: {e}") from None
    return tmp
