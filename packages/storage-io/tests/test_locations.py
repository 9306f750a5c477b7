"""Locations: paths and URLs, the filesystem of each, and clear errors for the ones that name no filesystem."""

from __future__ import annotations

import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

import storage_io
from storage_io import LocationError, StorageError


def test_protocols_and_paths():
    assert storage_io.protocol_of("/data/x") == "file"
    assert storage_io.protocol_of("S3://bucket/k") == "s3"
    assert [storage_io.is_url(u) for u in ("/a", "file:///a", "local:///a", "memory://a", "gs://b/a")] == [
        False,
        False,
        False,
        True,
        True,
    ]
    assert storage_io.strip_file_scheme("file:///tmp/x") == "/tmp/x"
    assert storage_io.strip_file_scheme("gs://b/x") == "gs://b/x"
    assert storage_io.join("s3://b/root/", "a", "b.json") == "s3://b/root/a/b.json"


def test_open_fs_gives_the_filesystem_and_its_path(tmp_path):
    fs, path = storage_io.open_fs(str(tmp_path / "x"))
    assert isinstance(fs, LocalFileSystem) and storage_io.is_local(fs) and path == str(tmp_path / "x")
    fs, path = storage_io.open_fs(f"file://{tmp_path}/y")
    assert storage_io.is_local(fs) and path == f"{tmp_path}/y"
    fs, path = storage_io.open_fs("memory://loc/a")
    assert isinstance(fs, MemoryFileSystem) and storage_io.is_process_local(fs) and not storage_io.is_local(fs)
    assert path == "/loc/a"


def test_a_protocol_without_its_backend_names_the_package_to_install():
    with pytest.raises(ImportError):
        fsspec.filesystem("abfs")  # the reference: adlfs is not installed here
    with pytest.raises(LocationError, match=r"abfs://c/x: the abfs:// filesystem needs .* Run: pip install adlfs") as e:
        storage_io.open_fs("abfs://c/x")
    assert e.value.backend == "adlfs" and e.value.location == "abfs://c/x" and isinstance(e.value, ValueError)


def test_an_unknown_protocol_is_a_clear_error():
    with pytest.raises(LocationError, match=r"nosuchfs://x: not a path or a known fsspec URL .* Check the spelling"):
        storage_io.open_fs("nosuchfs://x")


def test_a_url_mangled_by_pathlib_is_caught():
    with pytest.raises(ValueError, match=r"went through pathlib\.Path"):
        storage_io.check_not_mangled(Path("s3://bucket/prefix"))
    storage_io.check_not_mangled("s3://bucket/prefix")
    storage_io.check_not_mangled(Path("/tmp/x"))


@pytest.mark.parametrize(("protocol", "variable"), [("s3", "AWS_ENDPOINT_URL"), ("gs", "STORAGE_EMULATOR_HOST")])
def test_an_unreachable_endpoint_fails_in_bounded_time(monkeypatch, protocol, variable):
    """A configured endpoint where nothing listens: a clear error within seconds, not the client's retries."""
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(variable, f"http://127.0.0.1:{port}")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    start = time.monotonic()
    with pytest.raises(StorageError) as caught:
        storage_io.open_fs(f"{protocol}://bucket/key")
    assert time.monotonic() - start < storage_io.endpoints.CONNECT_TIMEOUT_S + 1
    message = str(caught.value)
    assert caught.value.reason == "unreachable" and f"{protocol}://bucket/key" in message
    assert f"127.0.0.1:{port}" in message and variable in message and "Check that the server is up" in message


def test_a_reachable_endpoint_is_checked_once(s3_server, monkeypatch):
    calls = []
    real = storage_io.endpoints.socket.create_connection
    monkeypatch.setattr(storage_io.endpoints, "_answered", {})
    monkeypatch.setattr(
        storage_io.endpoints.socket, "create_connection", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    for _ in range(3):
        storage_io.open_fs("s3://some-bucket/key")
    assert len(calls) == 1


def test_importing_it_loads_no_fsspec():
    """fsspec (with asyncio) loads on first use, so a package that only classifies errors does not pay for it."""
    import subprocess
    import sys

    code = "import sys, storage_io; storage_io.classify(OSError()); print('fsspec' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
