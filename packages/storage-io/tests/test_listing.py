"""list_keys: every object under a location, on local disk and in GCS buckets (fake-gcs-server, and an emulator
that answers listings with objects outside the prefix), checked against the servers' own listings."""

import json
import os
import urllib.parse
import urllib.request

import pytest

import storage_io
from storage_io import StorageError

NAMES = ["a", "run/c/step-1/x", "run/c/step-1/y/z", "run/c/step-2/x", "run/c0", "run/d"]


def upload(endpoint: str, bucket: str, names: list[str]) -> None:
    """Objects written with the plain JSON API (not through the code under test)."""
    for name in names:
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(
            f"{endpoint}/upload/storage/v1/b/{bucket}/o?{query}", data=name.encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()


def server_listing(endpoint: str, bucket: str, prefix: str) -> list[str]:
    """What the server lists under `prefix` (by `prefix`, which every emulator honours), made relative."""
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}/o?{query}", timeout=10) as response:
        return sorted(item["name"][len(prefix) :] for item in json.load(response).get("items", []))


def test_local_keys_are_those_of_os_walk(tmp_path):
    for name in NAMES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    walked = sorted(
        os.path.relpath(os.path.join(top, f), tmp_path / "run").replace(os.sep, "/")
        for top, _, files in os.walk(tmp_path / "run")
        for f in files
    )
    assert (
        storage_io.list_keys(str(tmp_path / "run")) == walked == ["c/step-1/x", "c/step-1/y/z", "c/step-2/x", "c0", "d"]
    )
    assert storage_io.list_keys(str(tmp_path / "missing")) == []


def test_gcs_keys_are_the_servers_listing_by_prefix(gcs_server):
    bucket = gcs_server.new_bucket("list")
    upload(gcs_server.endpoint, bucket, NAMES)
    assert storage_io.list_keys(gcs_server.url(bucket, "run/c")) == server_listing(
        gcs_server.endpoint, bucket, "run/c/"
    )
    assert storage_io.list_keys(gcs_server.url(bucket, "run/c/")) == ["step-1/x", "step-1/y/z", "step-2/x"]
    assert storage_io.list_keys(gcs_server.url(bucket)) == sorted(NAMES)
    assert storage_io.list_keys(gcs_server.url(bucket, "nothing")) == []


def test_names_listed_outside_the_prefix_are_left_out(offset_blind_gcs_endpoint, monkeypatch):
    import gcsfs

    bucket = "blind"
    request = urllib.request.Request(
        f"{offset_blind_gcs_endpoint}/storage/v1/b?project=test",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).read()
    upload(offset_blind_gcs_endpoint, bucket, NAMES)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", offset_blind_gcs_endpoint)
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        keys = storage_io.list_keys(f"gs://{bucket}/run/c")
    finally:
        gcsfs.GCSFileSystem.clear_instance_cache()
    assert keys == server_listing(offset_blind_gcs_endpoint, bucket, "run/c/")


def test_an_unreachable_endpoint_is_a_storage_error_that_names_the_url(monkeypatch):
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    with pytest.raises(StorageError) as caught:
        storage_io.list_keys("gs://bucket/prefix")
    assert caught.value.reason == "unreachable" and "gs://bucket/prefix" in str(caught.value)
    assert "STORAGE_EMULATOR_HOST" in str(caught.value)
