"""Locations: a local path or an fsspec URL (file://, memory://, s3://, gs://, ...), and the filesystem of one."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from storage_io.endpoints import check_reachable, client_options, prepare_gcs
from storage_io.errors import StorageError

if TYPE_CHECKING:
    import fsspec
# fsspec (~0.2 s to import, asyncio included) is imported on first use, so that a package that only classifies
# errors or writes local files (dist-ckpt) does not pay for it at import.

# The fsspec backend package of each protocol that fsspec itself does not carry.
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
_LOCAL = ("file", "local")


class LocationError(StorageError, ValueError):
    """A location that names no usable filesystem: an unknown protocol, or one whose backend is not installed.

    `protocol` is the URL's scheme; `backend` the package that would serve it ("" when there is none).
    """

    def __init__(self, message: str, *, location: str, protocol: str, backend: str):
        super().__init__(message, location=location, reason="other")
        self.protocol = protocol
        self.backend = backend


def protocol_of(url: str) -> str:
    """The URL's scheme, lowercased ('file' for plain paths)."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def is_url(path: str) -> bool:
    """Whether `path` is an fsspec URL with a protocol other than plain local files."""
    return protocol_of(path) not in _LOCAL


def strip_file_scheme(path: str) -> str:
    """A local path without a file:// or local:// prefix."""
    return path.split("://", 1)[1] if path.startswith(("file://", "local://")) else path


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', the separator of every fsspec filesystem."""
    return "/".join([base.rstrip("/"), *parts])


def check_not_mangled(value: str | os.PathLike) -> None:
    """Raise ValueError for a URL that went through pathlib.Path, which turned its '//' into '/'."""
    text = os.fspath(value)
    if not isinstance(value, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.\-]+:/[^/]", text):
        raise ValueError(
            f"Location {text!r} looks like a URL that went through pathlib.Path, which turned its '//' into '/'. "
            "Pass URLs as strings, e.g. 's3://bucket/prefix'."
        )


def open_fs(
    url: str, *, listings_cache: bool = False, check_endpoint: bool = True
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of `url` and the path inside it.

    Listings are not cached by default: a directory that other processes write would hide their files behind a
    stale listing. With `check_endpoint`, an explicitly configured endpoint that does not answer is a StorageError
    within a few seconds, instead of the client's own retries (half a minute for gcsfs).
    """
    protocol = protocol_of(url)
    if check_endpoint:  # first: before the client's import and credential lookup, which take seconds
        check_reachable(protocol, url)
    if protocol in ("gs", "gcs"):
        prepare_gcs()
    options: dict[str, Any] = {} if listings_cache or protocol in _LOCAL else {"use_listings_cache": False}
    options.update(client_options(protocol))
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        backend = BACKENDS.get(protocol, "")
        fix = f"pip install {backend}" if backend else "install the fsspec filesystem for it"
        raise LocationError(
            f"{url}: the {protocol}:// filesystem needs a package that is not installed ({exc}). Run: {fix}.",
            location=url,
            protocol=protocol,
            backend=backend,
        ) from exc
    except ValueError as exc:
        raise LocationError(
            f"{url}: not a path or a known fsspec URL ({exc}). Check the spelling.",
            location=url,
            protocol=protocol,
            backend=BACKENDS.get(protocol, ""),
        ) from exc
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when `fs` is the local disk (atomic rename and hard links are available)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def is_process_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when other processes cannot see what this process writes (fsspec's memory://)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "memory" in protocols
