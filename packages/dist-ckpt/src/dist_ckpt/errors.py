"""Errors raised by dist_ckpt; each message names the checkpoint, key path or file and the fix."""


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
