"""The endpoints and settings of object stores, from each ecosystem's standard variables, and a bounded check
that an explicitly configured endpoint answers at all.

Credentials and endpoints come only from the standard settings: `AWS_*` for s3 (s3fs, through botocore, reads
`AWS_ENDPOINT_URL`, the keys and the region), Application Default Credentials and `STORAGE_EMULATOR_HOST` for gcs.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.parse

from storage_io.errors import FIXES, StorageError

# What processes started elsewhere (Ray workers) need to reach the same stores as their driver. Paths to
# credential files are not forwarded: they belong to the driver's host.
STORAGE_ENV_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "STORAGE_EMULATOR_HOST",
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
)
# How long a connection to an endpoint may take before it counts as unreachable, and how long an endpoint that
# answered is trusted without asking again.
CONNECT_TIMEOUT_S = 5.0
_TRUSTED_FOR_S = 30.0
_answered: dict[tuple[str, int], float] = {}
_lock = threading.Lock()


def prepare_gcs() -> None:
    """Turn off gcsfs's gRPC bucket-type probe when an emulator is configured (unless the user set the switch).

    gcsfs >= 2026 first asks a bucket for its type over gRPC. An emulator speaks only the JSON API: the probe
    fails on every call and logs a warning each time (or, where ADC exist, reaches for the real service).
    gcsfs reads the switch at import.
    """
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def configured_endpoint(protocol: str) -> str | None:
    """The endpoint URL that the standard variables set for `protocol` ("s3", "gs"), or None (the public one)."""
    if protocol in ("s3", "s3a"):
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    if protocol in ("gs", "gcs"):
        host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
        if host:
            return host if "://" in host else f"http://{host}"
    return None


def check_reachable(protocol: str, location: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise a StorageError (reason "unreachable") when the configured endpoint of `protocol` does not accept a
    connection within `timeout` seconds; public endpoints are left to the client (they may need a proxy)."""
    endpoint = configured_endpoint(protocol)
    if endpoint is None:
        return
    parsed = urllib.parse.urlsplit(endpoint)
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    with _lock:
        if time.monotonic() - _answered.get((host, port), -_TRUSTED_FOR_S) < _TRUSTED_FOR_S:
            return
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        variable = "STORAGE_EMULATOR_HOST" if protocol in ("gs", "gcs") else "AWS_ENDPOINT_URL"
        raise StorageError(
            f"{location}: cannot reach its endpoint {endpoint} ({variable}) within {timeout:.0f} s "
            f"({type(exc).__name__}: {exc}): {FIXES['unreachable']}.",
            location=location,
            reason="unreachable",
        ) from None
    with _lock:
        _answered[(host, port)] = time.monotonic()


def client_options(protocol: str) -> dict:
    """Options that bound how long the client of `protocol` tries one request (botocore retries for ~10 s by
    default against a closed port, and waits 60 s to connect to a silent one)."""
    # botocore's default ("legacy") retries took 24 s to give up on an endpoint that refuses every connection, and
    # "standard" mode's 3 attempts 13 s; two give up in ~4 s, and s3fs retries transient transfer errors on top.
    # A user's own AWS_RETRY_MODE / AWS_MAX_ATTEMPTS win.
    if protocol in ("s3", "s3a") and not (os.environ.get("AWS_RETRY_MODE") or os.environ.get("AWS_MAX_ATTEMPTS")):
        return {
            "config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "retries": {"max_attempts": 2, "mode": "standard"}}
        }
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return {}


def storage_env() -> dict[str, str]:
    """The standard storage settings of this process that are set (to hand to workers)."""
    return {key: os.environ[key] for key in STORAGE_ENV_KEYS if key in os.environ}


def apply_storage_env(env: dict[str, str]) -> None:
    """Adopt a driver's storage settings in a worker; cached filesystems made under other settings are dropped."""
    changed = False
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
            changed = True
    if changed:
        import fsspec

        for protocol in ("s3", "gs"):
            cls = fsspec.registry.get(protocol)
            if cls is not None:
                cls.clear_instance_cache()
