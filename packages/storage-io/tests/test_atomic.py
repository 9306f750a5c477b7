"""Atomic writes, exclusive creates and reads on local disk, fsspec's memory:// and moto's S3 server."""

from __future__ import annotations

import errno
import os
import stat
import threading

import boto3
import pytest

import storage_io
from storage_io import StorageError


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(previous)


def _leftovers(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(storage_io.TMP_PREFIX)]


def test_local_write_replaces_whole_with_the_umask_mode(tmp_path, umask_027):
    fs, path = storage_io.open_fs(str(tmp_path / "sub" / "a.json"))
    storage_io.write_atomic(fs, path, b"first")
    storage_io.write_atomic(fs, path, b"second")
    target = tmp_path / "sub" / "a.json"
    assert target.read_bytes() == b"second" and storage_io.read_bytes(fs, path) == b"second"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # 0666 & ~027, as open() makes it (not mkstemp's 0600)
    assert storage_io.current_umask() == 0o027 and storage_io.file_mode(directory=True) == 0o750
    assert _leftovers(tmp_path / "sub") == []


def test_a_write_that_fails_midway_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    target.write_bytes(b"old")
    fs, path = storage_io.open_fs(str(target))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StorageError) as caught:
        storage_io.write_atomic(fs, path, b"new")
    assert target.read_bytes() == b"old" and _leftovers(tmp_path) == []
    assert caught.value.reason == "full" and caught.value.location == str(target)
    assert str(caught.value).startswith(f"{target}: cannot write it") and "Free space" in str(caught.value)


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(small_disk):
    fs, path = storage_io.open_fs(str(small_disk / "big.bin"))
    with pytest.raises(StorageError) as caught:
        storage_io.write_atomic(fs, path, b"x" * 200_000)
    assert caught.value.reason == "full" and "no space left on the device" in str(caught.value)
    assert list(small_disk.iterdir()) == []


def test_a_folder_that_is_a_file_is_named_with_the_fix(tmp_path):
    (tmp_path / "notes").write_text("a file")
    fs, path = storage_io.open_fs(str(tmp_path / "notes" / "x.json"))
    with pytest.raises(StorageError) as caught:
        storage_io.write_atomic(fs, path, b"{}")
    assert caught.value.reason == "not_a_directory" and str(tmp_path / "notes" / "x.json") in str(caught.value)
    assert "is a file, not a directory" in str(caught.value)
    with pytest.raises(StorageError, match="a directory is where a file was expected"):
        storage_io.read_bytes(fs, str(tmp_path))


def test_a_package_gives_its_own_error(tmp_path):
    class MineError(Exception):
        pass

    (tmp_path / "f").write_text("x")
    fs, _ = storage_io.open_fs(str(tmp_path))
    with pytest.raises(MineError, match=r"read .*f/y: not_a_directory"):
        storage_io.read_bytes(
            fs,
            str(tmp_path / "f" / "y"),
            error=lambda e, where, doing: MineError(f"{doing} {where}: {storage_io.classify(e)}"),
        )


def test_missing_files_pass_through_as_file_not_found(tmp_path):
    fs, path = storage_io.open_fs("memory://storage-io-tests/missing")
    with pytest.raises(FileNotFoundError):
        storage_io.read_bytes(fs, path)
    assert storage_io.list_names(fs, "/storage-io-tests/nothing-here") == []
    assert storage_io.list_names(*storage_io.open_fs(str(tmp_path / "none"))) == []


def test_exclusive_create_has_one_winner_locally(tmp_path):
    fs, path = storage_io.open_fs(str(tmp_path / "lock"))
    won = []

    def create(i: int) -> None:
        try:
            storage_io.create_exclusive(fs, path, str(i).encode())
            won.append(i)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and (tmp_path / "lock").read_bytes() == str(won[0]).encode()
    assert _leftovers(tmp_path) == []


def test_memory_filesystem_round_trip():
    fs, root = storage_io.open_fs("memory://storage-io-tests/round")
    storage_io.write_atomic(fs, f"{root}/a", b"1")
    storage_io.create_exclusive(fs, f"{root}/b", b"2")
    with pytest.raises(FileExistsError):
        storage_io.create_exclusive(fs, f"{root}/b", b"3")
    fs.pipe_file(f"{root}/{storage_io.TMP_PREFIX}x", b"partial")
    assert storage_io.list_names(fs, root) == [f"{storage_io.TMP_PREFIX}x", "a", "b"]
    assert storage_io.remove_leftover_tmp_files(fs, root) == 1
    assert storage_io.list_names(fs, root) == ["a", "b"] and storage_io.read_bytes(fs, f"{root}/b") == b"2"
    storage_io.remove(fs, f"{root}/a")
    storage_io.remove(fs, f"{root}/a")  # already gone: fine
    assert storage_io.list_names(fs, root) == ["b"]


def test_s3_round_trip_read_back_with_boto3(s3_server):
    bucket = s3_server.new_bucket()
    fs, root = storage_io.open_fs(s3_server.url(bucket, "dir"))
    storage_io.write_atomic(fs, f"{root}/a.json", b'{"a": 1}')
    storage_io.create_exclusive(fs, f"{root}/lock", b"me")
    with pytest.raises(FileExistsError):
        storage_io.create_exclusive(fs, f"{root}/lock", b"you")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    assert client.get_object(Bucket=bucket, Key="dir/a.json")["Body"].read() == b'{"a": 1}'
    assert client.get_object(Bucket=bucket, Key="dir/lock")["Body"].read() == b"me"
    assert storage_io.list_names(fs, root) == ["a.json", "lock"]


def test_s3_missing_bucket_and_missing_credentials_say_the_fix(s3_server, monkeypatch):
    fs, path = storage_io.open_fs("s3://no-such-bucket-here/key")
    with pytest.raises(StorageError) as caught:
        storage_io.write_atomic(fs, path, b"x")
    assert caught.value.reason == "no_bucket"
    assert "no-such-bucket-here/key" in str(caught.value) and "Create it, or fix the bucket name" in str(caught.value)

    import s3fs

    bucket = s3_server.new_bucket()  # it exists: only the credentials are missing
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        fs, path = storage_io.open_fs(f"s3://{bucket}/key")
        with pytest.raises(StorageError) as caught:
            storage_io.read_bytes(fs, path)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert caught.value.reason == "no_credentials" and f"{bucket}/key" in str(caught.value)
    assert "AWS_ACCESS_KEY_ID" in str(caught.value)
