"""Where checkpoint files live: a local directory, an fsspec URL (gs://, s3://, ...) read in place, or a hub id.

A `Location` reads whole small files (JSON) and byte ranges of large ones (safetensors), so that a checkpoint
at a URL is never copied whole: each process fetches the bytes it needs. Credentials and endpoints come only
from each storage's standard settings (AWS_* for s3, Application Default Credentials or STORAGE_EMULATOR_HOST
for gcs), which fsspec's backends read themselves.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import fsspec

import storage_io

from .errors import HfBridgeError
from .hub import download_snapshot, looks_like_hub_id

CHECKPOINT_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model")
is_url = storage_io.is_url
strip_file_scheme = storage_io.strip_file_scheme


def storage_errors() -> tuple[type[BaseException], ...]:
    """The errors a store raises when it cannot be reached or read: OSError, and botocore's own (not OSErrors,
    such as EndpointConnectionError) once s3fs has loaded it."""
    botocore = sys.modules.get("botocore.exceptions")
    return (OSError, botocore.BotoCoreError) if botocore is not None else (OSError,)


def url_fs(url: str, what: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec file system and path of a URL; a missing backend is an error that names the package."""
    try:
        return storage_io.open_fs(url)  # fresh listings: a checkpoint is written by other processes
    except storage_io.LocationError as e:
        package = e.backend
        hint = f"install {package} (`pip install {package}`)" if package else "install the fsspec backend it needs"
        raise HfBridgeError(f"Cannot open the {what} URL {url!r} ({e.__cause__ or e}); {hint}.") from None
    except storage_io.StorageError as e:
        raise HfBridgeError(f"Cannot open the {what} URL {url!r}: {e}") from None


def storage_error(error: BaseException, where: str, doing: str) -> HfBridgeError:
    """A clear error for an OSError met while reading or writing `where`, with the fix for its cause."""
    reason = storage_io.classify(error)
    if reason == "denied":
        fix = "give the user running this access to it (e.g. `chmod a+r` for a file, or the bucket's IAM role)"
    elif reason == "not_found":
        fix = "the checkpoint is incomplete: export it again or download the missing file"
    elif reason == "full":
        fix = "free space there, or choose another destination"
    elif reason == "other":
        fix = "check the storage and the network, then try again"
    else:
        fix = storage_io.FIXES[reason]
    return HfBridgeError(f"{doing} {where} failed: {storage_io.detail_of(error)}. {fix[0].upper()}{fix[1:]}.")


class Location:
    """A directory of checkpoint files, local or at an fsspec URL, read by name."""

    def __init__(self, text: str, fs: fsspec.AbstractFileSystem | None, root: str) -> None:
        self.text = text  # as given, for messages
        self.fs = fs  # None: a local directory, read with plain file operations
        self.root = root.rstrip("/") if fs is not None else root

    @property
    def remote(self) -> bool:
        return self.fs is not None

    def where(self, name: str) -> str:
        """A file's full path or URL, for messages."""
        if self.fs is None:
            return str(Path(self.root) / name)
        return f"{self.text.rstrip('/')}/{name}"

    def local_path(self, name: str) -> Path:
        return Path(self.root) / name

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _remote(self) -> fsspec.AbstractFileSystem:
        """The filesystem of a URL; only called where `self.fs` was checked (a local directory has none)."""
        assert self.fs is not None
        return self.fs

    def exists(self, name: str) -> bool:
        if self.fs is None:
            return self.local_path(name).is_file()
        return self._guard(lambda: self._remote().isfile(self._path(name)), name, "Looking for")

    def names(self) -> list[str]:
        """The names of the files in the directory."""
        if self.fs is None:
            return sorted(p.name for p in Path(self.root).iterdir() if p.is_file())
        entries = self._guard(lambda: self._remote().ls(self.root, detail=True), "", "Listing")
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")

    def size(self, name: str) -> int:
        if self.fs is None:
            return self._guard(lambda: self.local_path(name).stat().st_size, name, "Reading")
        return int(self._guard(lambda: self._remote().info(self._path(name))["size"], name, "Reading"))

    def read_bytes(self, name: str) -> bytes:
        if self.fs is None:
            return self._guard(self.local_path(name).read_bytes, name, "Reading")
        return self._guard(lambda: self._remote().cat_file(self._path(name)), name, "Reading")

    def read_range(self, name: str, start: int, end: int) -> bytes | bytearray:
        """Bytes [start, end) of a file (one ranged GET at a URL); fewer means the file is shorter."""
        if self.fs is None:
            buffer = bytearray(end - start)
            view, done = memoryview(buffer), 0
            with self.open_local(name) as f:
                f.seek(start)
                while done < len(buffer):
                    n = self._guard(functools.partial(f.readinto, view[done:]), name, "Reading")
                    if not n:
                        return bytes(buffer[:done])
                    done += n
            return buffer
        # s3fs takes version_id as its second positional argument: pass the range by keyword.
        return self._guard(lambda: self._remote().cat_file(self._path(name), start=start, end=end), name, "Reading")

    def read_ranges(self, requests: Sequence[tuple[str, int, int]]) -> list[bytes | bytearray]:
        """Several byte ranges (name, start, end) at once: concurrent requests at a URL."""
        if self.fs is None or len(requests) < 2:
            return [self.read_range(name, start, end) for name, start, end in requests]
        paths = [self._path(name) for name, _, _ in requests]
        starts = [start for _, start, _ in requests]
        ends = [end for _, _, end in requests]
        out = self._guard(
            lambda: self._remote().cat_ranges(paths, starts, ends, on_error="raise"), requests[0][0], "Reading"
        )
        return list(out)

    @contextlib.contextmanager
    def open_local(self, name: str) -> Iterator[Any]:
        """A local file opened for reading, with clear errors."""
        try:
            f = open(self.local_path(name), "rb", buffering=0)  # noqa: SIM115 (closed below)
        except storage_errors() as e:
            raise storage_error(e, self.where(name), "Reading") from None
        try:
            yield f
        finally:
            f.close()

    def _guard(self, fn: Any, name: str, doing: str) -> Any:
        try:
            return fn()
        except HfBridgeError:
            raise
        except storage_errors() as e:
            raise storage_error(e, self.where(name) if name else self.text, doing) from None


def open_location(path: str | os.PathLike, *, revision: str | None = None, what: str = "checkpoint") -> Location:
    """The Location of a checkpoint given as a directory, one of its files, an fsspec URL or a hub id."""
    text = os.fspath(path)
    if is_url(text):
        fs, root = url_fs(text, what)
        try:
            if fs.isfile(root):
                parent = text.rstrip("/").rsplit("/", 1)[0]
                return Location(parent, fs, root.rstrip("/").rsplit("/", 1)[0])
            if fs.isdir(root):
                return Location(text, fs, root)
        except storage_errors() as e:
            raise storage_error(e, text, "Opening") from None
        raise HfBridgeError(f"The {what} URL {text!r} does not exist (neither a file nor a directory).")
    local = Path(strip_file_scheme(text)).expanduser()
    if local.exists():
        directory = local.parent if local.is_file() else local
        return Location(str(directory), None, str(directory))
    if looks_like_hub_id(text):
        directory = download_snapshot(text, CHECKPOINT_FILES, revision)
        return Location(str(directory), None, str(directory))
    raise HfBridgeError(
        f"The {what} path {text!r} does not exist. Pass an existing local directory or file, an fsspec URL "
        "(e.g. gs://bucket/dir), or a Hugging Face Hub id."
    )


@contextlib.contextmanager
def local_copy(
    path: str | os.PathLike,
    *,
    patterns: Sequence[str] = CHECKPOINT_FILES,
    revision: str | None = None,
    what: str = "checkpoint",
) -> Iterator[Path]:
    """A local path for `path` (a directory or a file): itself, a temporary copy of a URL's small files, or a
    hub snapshot. For tokenizer files, which are small and read by libraries that want a local file."""
    text = os.fspath(path)
    if not is_url(text):
        local = Path(strip_file_scheme(text)).expanduser()
        if local.exists():
            yield local
        elif looks_like_hub_id(text):
            yield download_snapshot(text, patterns, revision)
        else:
            raise HfBridgeError(
                f"The {what} path {text!r} does not exist. Pass an existing local directory or file, an fsspec URL "
                "(e.g. gs://bucket/dir), or a Hugging Face Hub id."
            )
        return
    fs, root = url_fs(text, what)
    with tempfile.TemporaryDirectory(prefix="hf_bridge_") as tmp:
        yield _copy_small_files(fs, root, text, Path(tmp), patterns, what)


def _copy_small_files(fs: Any, root: str, text: str, tmp: Path, patterns: Sequence[str], what: str) -> Path:
    try:
        if fs.isfile(root):
            target = tmp / root.rstrip("/").rsplit("/", 1)[-1]
            fs.get_file(root, str(target))
            return target
        if not fs.isdir(root):
            raise HfBridgeError(f"The {what} URL {text!r} does not exist (neither a file nor a directory).")
        for entry in fs.ls(root, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if any(fnmatch(name, p) for p in patterns) and fs.isfile(entry):
                fs.get_file(entry, str(tmp / name))
    except storage_errors() as e:
        raise storage_error(e, text, "Reading") from None
    return tmp
