"""Atomic, asynchronous, reshardable, checksummed checkpoints of jax pytrees, stored as zarr3 arrays with
tensorstore on local disk or in s3:// and gs:// buckets."""

from dist_ckpt.checkpointer import Checkpointer, KeepPolicy
from dist_ckpt.discovery import CheckpointInfo, TornCheckpointWarning, latest, list_checkpoints, resolve_checkpoint
from dist_ckpt.errors import (
    BackgroundSaveError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    TreeMismatchError,
)
from dist_ckpt.layout import read_manifest
from dist_ckpt.load import load
from dist_ckpt.policy import Decision
from dist_ckpt.retries import RetryPolicy, retry_policy, set_retry_policy
from dist_ckpt.save import save, wait
from dist_ckpt.verify import quarantine, verify
from dist_ckpt.writer import SaveJob

__all__ = [
    "BackgroundSaveError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptCheckpointError",
    "Decision",
    "KeepPolicy",
    "RetryPolicy",
    "SaveJob",
    "StorageError",
    "TornCheckpointWarning",
    "TreeMismatchError",
    "latest",
    "list_checkpoints",
    "load",
    "quarantine",
    "read_manifest",
    "resolve_checkpoint",
    "retry_policy",
    "save",
    "set_retry_policy",
    "verify",
    "wait",
]
