"""Storage errors: each kind of failure is recognised from the real exception and gets its fix."""

from __future__ import annotations

import errno
import pickle

import pytest

import storage_io
from storage_io import StorageError


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "full"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "full"),
        (PermissionError(errno.EACCES, "Permission denied"), "denied"),
        (OSError(errno.EROFS, "Read-only file system"), "read_only"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory"), "not_a_directory"),
        (IsADirectoryError(errno.EISDIR, "Is a directory"), "is_a_directory"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "unreachable"),
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), "not_found"),
        (FileNotFoundError("The specified bucket does not exist"), "no_bucket"),
        (ValueError("something else"), "other"),
    ],
)
def test_classify(error, reason):
    assert storage_io.classify(error) == reason
    made = storage_io.storage_error(error, "gs://b/k", "write")
    assert made.reason == reason and made.location == "gs://b/k" and str(made).startswith("gs://b/k: cannot write it")
    assert storage_io.FIXES[reason] in str(made)


def test_the_cause_is_found_through_wrapping_exceptions():
    try:
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        except OSError as inner:
            raise RuntimeError("request failed") from inner
    except RuntimeError as outer:
        assert storage_io.classify(outer) == "unreachable"


def test_botocore_credentials_error_is_no_credentials():
    botocore = pytest.importorskip("botocore.exceptions")
    assert storage_io.classify(botocore.NoCredentialsError()) == "no_credentials"
    assert storage_io.classify(botocore.EndpointConnectionError(endpoint_url="http://x")) == "unreachable"


def test_storage_errors_survive_pickling():
    error = storage_io.storage_error(OSError(errno.ENOSPC, "No space left on device"), "/d/f", "write")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is StorageError and str(back) == str(error) and back.reason == "full" and back.location == "/d/f"
    assert isinstance(back, OSError)
