"""Storage glue on fsspec: locations, atomic writes, umask-respecting modes, retries and storage errors with fixes."""

from typing import Any

from storage_io.atomic import (
    TMP_PREFIX,
    create_exclusive,
    current_umask,
    file_mode,
    fsync_dir,
    list_names,
    read_bytes,
    remove,
    remove_leftover_tmp_files,
    write_atomic,
    write_local_atomic,
    write_temporary,
)
from storage_io.endpoints import (
    STORAGE_ENV_KEYS,
    apply_storage_env,
    check_reachable,
    configured_endpoint,
    storage_env,
)
from storage_io.errors import (
    FIXES,
    REASONS,
    ErrorFactory,
    StorageError,
    classify,
    detail_of,
    is_storage_failure,
    storage_error,
)
from storage_io.listing import list_keys
from storage_io.locations import (
    BACKENDS,
    LocationError,
    check_not_mangled,
    is_local,
    is_process_local,
    is_url,
    join,
    open_fs,
    protocol_of,
    strip_file_scheme,
)
from storage_io.retries import RetryPolicy, is_transient, retry_policy, set_retry_policy, with_retries

__all__ = [
    "BACKENDS",
    "FIXES",
    "REASONS",
    "STORAGE_ENV_KEYS",
    "TMP_PREFIX",
    "ErrorFactory",
    "LocationError",
    "RetryPolicy",
    "StorageError",
    "apply_storage_env",
    "check_not_mangled",
    "check_reachable",
    "classify",
    "configured_endpoint",
    "create_exclusive",
    "current_umask",
    "detail_of",
    "file_mode",
    "fsync_dir",
    "is_local",
    "is_process_local",
    "is_storage_failure",
    "is_transient",
    "is_url",
    "join",
    "list_keys",
    "list_names",
    "open_fs",
    "protocol_of",
    "read_bytes",
    "remove",
    "remove_leftover_tmp_files",
    "retry_policy",
    "set_retry_policy",
    "storage_env",
    "storage_error",
    "strip_file_scheme",
    "with_retries",
    "write_atomic",
    "write_local_atomic",
    "write_temporary",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's: no copy to drift
        from importlib import metadata  # read on use: importing it costs tens of ms

        return metadata.version("storage-io")
    raise AttributeError(f"module 'storage_io' has no attribute {name!r}")
