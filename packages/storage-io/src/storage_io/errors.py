"""Storage errors: what kind of failure an exception is, and a one-paragraph message with its fix."""

from __future__ import annotations

import errno
from collections.abc import Callable

# The kinds of failure, each with the fix a user can apply. A package may word its own fix for a kind.
FIXES = {
    "no_credentials": (
        "no credentials were found for it. Set the store's standard credentials (AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY or a profile for s3, Application Default Credentials for gs), then run again"
    ),
    "no_bucket": "the bucket does not exist. Create it, or fix the bucket name in the URL",
    "unreachable": (
        "the storage did not answer. Check that the server is up and reachable (AWS_ENDPOINT_URL or "
        "STORAGE_EMULATOR_HOST, the network), then run again"
    ),
    "denied": (
        "permission denied. Give this user access to it: fix the file's permissions (ls -l, chmod/chown), or the "
        "credentials of the bucket"
    ),
    "not_a_directory": (
        "a part of the path is a file, not a directory. Remove or rename that file, or choose another path"
    ),
    "is_a_directory": "a directory is where a file was expected. Check the path",
    "full": "no space left on the device. Free space there (or choose a location with room), then run again",
    "read_only": "the file system is read-only. Use a writable location",
    "not_found": "no such file. Check the path or URL",
    "other": "check the path, the network and the credentials",
}
REASONS = tuple(FIXES)
# Names of exceptions that the object-store clients raise outside OSError (botocore, google-auth, aiohttp).
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError", "RefreshError")
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ServerTimeoutError")
_UNREACHABLE_CODES = (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)


class StorageError(OSError):
    """A location could not be read or written; `location` names it and `reason` is one of REASONS."""

    def __init__(self, message: str, *, location: str = "", reason: str = "other"):
        super().__init__(message)
        self.location = location
        self.reason = reason

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):  # keeps the fields across pickling (Ray workers)
        return (_rebuild, (type(self), str(self), self.location, self.reason))


def _rebuild(cls: type[StorageError], message: str, location: str, reason: str) -> StorageError:
    error = cls.__new__(cls)
    StorageError.__init__(error, message, location=location, reason=reason)
    return error


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from (clients wrap the socket error several times)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen and len(seen) < 8:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def classify(error: BaseException) -> str:
    """The kind of failure that `error` is: one of REASONS."""
    if isinstance(error, StorageError):
        return error.reason
    for cause in _chain(error):
        names = {c.__name__ for c in type(cause).__mro__}
        text = str(cause)
        code = getattr(cause, "errno", None)
        if names & set(_NO_CREDENTIALS) or "Unable to locate credentials" in text:
            return "no_credentials"
        if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
            return "no_bucket"
        if code in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in text:
            return "full"
        if isinstance(cause, PermissionError) or code in (errno.EACCES, errno.EPERM) or "AccessDenied" in text:
            return "denied"
        if code == errno.EROFS:
            return "read_only"
        # makedirs meets an existing file as EEXIST: a part of the path is a file where a directory must be.
        if isinstance(cause, NotADirectoryError | FileExistsError) or code in (errno.ENOTDIR, errno.EEXIST):
            return "not_a_directory"
        if isinstance(cause, IsADirectoryError) or code == errno.EISDIR:
            return "is_a_directory"
        if names & set(_UNREACHABLE) or isinstance(cause, ConnectionError | TimeoutError) or code in _UNREACHABLE_CODES:
            return "unreachable"
        if isinstance(cause, FileNotFoundError) or code == errno.ENOENT:
            return "not_found"
    return "other"


def is_storage_failure(exc: BaseException) -> bool:
    """Whether `exc` is a failure of the storage rather than of the caller's code."""
    # Object-store clients raise their own exceptions for some failures (botocore's are not OSErrors).
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("botocore", "google", "aiohttp", "gcsfs")


def detail_of(error: BaseException) -> str:
    """The cause's own words, without the "[Errno N]" prefix."""
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


def storage_error(error: BaseException, location: str, doing: str) -> StorageError:
    """A StorageError for a failed `doing` ("read", "write", ...) of `location`, with the fix for its kind."""
    if isinstance(error, StorageError):
        return error
    reason = classify(error)
    fix = FIXES[reason]
    return StorageError(
        f"{location}: cannot {doing} it ({type(error).__name__}: {detail_of(error)}): {fix}.",
        location=location,
        reason=reason,
    )


# How a package turns a failure into its own exception: (error, location, doing) -> exception to raise.
ErrorFactory = Callable[[BaseException, str, str], Exception]
