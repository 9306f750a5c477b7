"""Retries: transient failures are tried again with bounded backoff; the rest fail at once."""

from __future__ import annotations

import errno
import threading
import time

import pytest

import storage_io
from storage_io import RetryPolicy


def test_policy_bounds_and_validation():
    policy = RetryPolicy(max_attempts=5, initial_delay=0.5, max_delay=1.5)
    assert policy.delays() == [0.5, 1.0, 1.5, 1.5] and policy.bound_seconds == 4.5
    assert policy.describe() == "5 attempts over about 4 s"
    for bad in ({"max_attempts": 0}, {"initial_delay": 0}, {"initial_delay": 2.0, "max_delay": 1.0}):
        with pytest.raises(ValueError, match="is not a retry policy"):
            RetryPolicy(**bad)
    previous = storage_io.set_retry_policy(policy)
    try:
        assert storage_io.retry_policy() is policy
    finally:
        storage_io.set_retry_policy(previous)
    with pytest.raises(TypeError):
        storage_io.set_retry_policy("fast")


def test_transient_failures_are_retried_with_backoff():
    failures = [ConnectionRefusedError(errno.ECONNREFUSED, "refused"), TimeoutError("timed out")]
    waits: list[float] = []

    def flaky():
        if failures:
            raise failures.pop(0)
        return "done"

    policy = RetryPolicy(max_attempts=4, initial_delay=0.1, max_delay=0.4)
    assert storage_io.with_retries(flaky, policy, sleep=waits.append) == "done"
    assert len(waits) == 2 and 0.05 <= waits[0] <= 0.1 and 0.1 <= waits[1] <= 0.2


def test_the_last_failure_propagates_and_permanent_ones_are_not_retried():
    calls = []

    def down():
        calls.append(1)
        raise ConnectionResetError(errno.ECONNRESET, "reset")

    with pytest.raises(ConnectionResetError):
        storage_io.with_retries(
            down, RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.01), sleep=lambda s: None
        )
    assert len(calls) == 3

    def denied():
        calls.append(2)
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        storage_io.with_retries(denied, RetryPolicy(max_attempts=5), sleep=lambda s: None)
    assert calls.count(2) == 1
    assert storage_io.is_transient(OSError("An error occurred (SlowDown) when calling PutObject"))
    assert not storage_io.is_transient(FileNotFoundError(errno.ENOENT, "nope"))
    # A status code inside a path is no reason to retry: the kind of failure comes first.
    assert not storage_io.is_transient(FileNotFoundError(errno.ENOENT, "No such file", "chunk-503 Service.parquet"))
    assert storage_io.is_transient(OSError("HTTP 503 Service Unavailable"))


def test_a_short_s3_outage_is_ridden_out(s3_server):
    bucket = s3_server.new_bucket()
    fs, root = storage_io.open_fs(s3_server.url(bucket, "ride"))
    previous = storage_io.set_retry_policy(RetryPolicy(max_attempts=10, initial_delay=0.2, max_delay=1.0))
    s3_server.stop()
    restart = threading.Timer(1.5, s3_server.start)
    restart.start()
    try:
        start = time.monotonic()
        storage_io.write_atomic(fs, f"{root}/a", b"after the outage")
        assert time.monotonic() - start >= 1.0  # it did wait for the server
    finally:
        restart.join()
        storage_io.set_retry_policy(previous)
    assert storage_io.read_bytes(fs, f"{root}/a") == b"after the outage"
