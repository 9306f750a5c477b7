"""Fixtures for the storage-io tests: a small disk that fills up (a tmpfs the test mounts)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid

import pytest


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs, unmounted after the test; skipped where mounting is impossible (it needs root)."""
    point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): no full disk to make")
    try:
        yield point
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["umount", "-l", str(point)], check=False, capture_output=True)
