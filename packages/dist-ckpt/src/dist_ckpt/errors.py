"""Errors raised by dist_ckpt; each message names the checkpoint, key path or file and the fix."""

import storage_io


class CheckpointError(Exception):
    """Base class of every error that dist_ckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint exists where one was required."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save would overwrite a complete checkpoint."""


class TreeMismatchError(CheckpointError, ValueError):
    """The target tree differs from the saved tree (structure, shape or kind of a leaf)."""


class BackgroundSaveError(CheckpointError):
    """A background write failed; raised by the next call into dist_ckpt after the failure."""


class StorageError(CheckpointError, storage_io.StorageError):
    """The storage could not be read or written: unreachable past the retries, access denied, or full.

    `url` is the file or object that failed (a local path or an s3:// / gs:// URL); `reason` is "full",
    "denied", "unreachable", "no_bucket" or "other", so that a caller can give its own fix.
    """

    def __init__(self, message: str, *, url: str, reason: str = "other"):
        storage_io.StorageError.__init__(self, message, location=url, reason=reason)

    @property
    def url(self) -> str:
        return self.location


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint is damaged: a file is truncated, altered, missing or not what the manifest says.

    `path` is the checkpoint, `key` the key path of the damaged leaf (None for the manifest or a marker), `file`
    the damaged file or object. On resume, fall back to an earlier checkpoint and `quarantine(path)` this one.
    """

    def __init__(self, message: str, *, path: str, file: str, key: str | None = None):
        super().__init__(message)
        self.path = path
        self.file = file
        self.key = key
