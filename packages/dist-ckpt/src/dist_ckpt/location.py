"""Where a checkpoint lives: a local directory or an s3:// or gs:// prefix, and its tensorstore kvstore spec.

Credentials and endpoints come only from each ecosystem's standard settings, turned into tensorstore's spec
here: for s3, `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` and `AWS_REGION` / `AWS_DEFAULT_REGION` (tensorstore
reads the keys, `AWS_ACCESS_KEY_ID` etc., itself: only from the environment when they are there and no
`AWS_PROFILE` is named); for gcs, Application Default Credentials (read by tensorstore) and
`STORAGE_EMULATOR_HOST`, which becomes `TENSORSTORE_GCS_HTTP_URL`, the variable tensorstore reads for another
GCS endpoint.
"""

import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import storage_io

REMOTE_SCHEMES = ("s3", "gs")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$")
# Where an emulator host came from, so that a later change of STORAGE_EMULATOR_HOST is followed.
_GCS_URL_VARIABLE = "TENSORSTORE_GCS_HTTP_URL"
_gcs_url_we_set: str | None = None


@dataclass(frozen=True)
class Location:
    """A checkpoint directory or root: `scheme` is "file", "s3" or "gs"; `path` is the absolute local path, or
    the key prefix inside `bucket` (no leading or trailing "/")."""

    scheme: str
    path: str
    bucket: str = ""

    @classmethod
    def parse(cls, value: "str | os.PathLike | Location") -> "Location":
        """A Location from a local path, a pathlib.Path, a file:// URL or an s3:// / gs:// URL."""
        if isinstance(value, Location):
            return value
        storage_io.check_not_mangled(value)
        if not isinstance(value, str):
            return cls("file", str(Path(os.fspath(value)).absolute()))
        match = _URL.match(value)
        if match is None:
            return cls("file", str(Path(value).absolute()))
        scheme, rest = match.group(1).lower(), match.group(2)
        if scheme == "file":
            return cls("file", str(Path(rest or "/").absolute()))
        if scheme not in REMOTE_SCHEMES:
            raise ValueError(
                f"Checkpoint location {value!r} has the scheme {scheme}://, which dist_ckpt does not write to. Use "
                "a local path, file://, s3://bucket/prefix or gs://bucket/prefix."
            )
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise ValueError(f"Checkpoint location {value!r} names no bucket: write {scheme}://BUCKET/PREFIX.")
        return cls(scheme, posixpath.normpath("/" + key).strip("/"), bucket)

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    def __str__(self) -> str:
        if self.is_local:
            return self.path
        return f"{self.scheme}://{self.bucket}/{self.path}".rstrip("/")

    def public(self) -> Path | str:
        """What dist_ckpt hands back to callers: a pathlib.Path for local directories, the URL otherwise."""
        return Path(self.path) if self.is_local else str(self)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def child(self, *names: str) -> "Location":
        """The location `names` below this one (names use "/" as separator on every storage)."""
        joined = "/".join(name.strip("/") for name in names if name)
        if self.is_local:
            return Location("file", str(Path(self.path, joined)))
        return Location(self.scheme, "/".join(p for p in (self.path, joined) if p), self.bucket)

    def sibling(self, name: str) -> "Location":
        """The location named `name` next to this one (in the same parent directory or prefix)."""
        parent = posixpath.dirname(self.path.rstrip("/"))
        if self.is_local:
            return Location("file", str(Path(parent, name)))
        return Location(self.scheme, "/".join(p for p in (parent, name) if p), self.bucket)

    def url_of(self, key: str = "") -> str:
        """The printable address of `key` below this location (a local path or a URL)."""
        return str(self.child(key)) if key else str(self)

    def kvstore_spec(self, key: str = "") -> dict[str, Any]:
        """The tensorstore kvstore spec of the directory `key` below this location (its path ends with "/")."""
        target = self.child(key) if key else self
        prefix = target.path.rstrip("/") + "/"
        if self.is_local:
            return {"driver": "file", "path": prefix}
        if prefix == "/":
            prefix = ""
        if self.scheme == "s3":
            return {"driver": "s3", "bucket": self.bucket, "path": prefix, **s3_settings()}
        apply_gcs_settings()
        return {"driver": "gcs", "bucket": self.bucket, "path": prefix}


def s3_settings() -> dict[str, Any]:
    """The endpoint, region and credential source of tensorstore's s3 kvstore, from the standard AWS variables.

    tensorstore does not read AWS_ENDPOINT_URL, and without an endpoint it asks the public AWS endpoint for the
    bucket's region: offline, that request hangs. So both go into the spec here.
    """
    settings: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        settings["endpoint"] = endpoint.rstrip("/")
        settings["aws_region"] = region or "us-east-1"  # S3-compatible servers accept any region in signatures
    elif region:
        settings["aws_region"] = region
    if _keys_in_environment():
        # The SDK's default chain would still read ~/.aws/config and ~/.aws/credentials and, where they are
        # missing, print ten `E... Failed to open file` lines per process though the keys were there all along.
        settings["context"] = {"aws_credentials": {"type": "environment"}}
    return settings


def _keys_in_environment() -> bool:
    """The AWS keys are in the environment and no profile is named, so the keys are the credentials."""
    keys = os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    return bool(keys) and not os.environ.get("AWS_PROFILE")


def apply_gcs_settings() -> None:
    """Point tensorstore's gcs kvstore at STORAGE_EMULATOR_HOST, the standard setting for a GCS emulator.

    tensorstore reads its own variable, TENSORSTORE_GCS_HTTP_URL, at each open; one that the user set is left
    alone. Without an emulator, tensorstore finds Application Default Credentials itself.
    """
    global _gcs_url_we_set
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    current = os.environ.get(_GCS_URL_VARIABLE)
    if current is not None and current != _gcs_url_we_set:
        return  # the user's own setting wins
    if emulator:
        url = emulator if "://" in emulator else f"http://{emulator}"
        os.environ[_GCS_URL_VARIABLE] = url.rstrip("/")
        _gcs_url_we_set = os.environ[_GCS_URL_VARIABLE]
    elif current is not None:
        del os.environ[_GCS_URL_VARIABLE]  # the emulator we pointed at is no longer configured
        _gcs_url_we_set = None
