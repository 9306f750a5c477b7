"""Atomic, asynchronous, reshardable checkpoints of jax pytrees, stored as zarr3 arrays with tensorstore."""

from dist_ckpt.checkpointer import Checkpointer, KeepPolicy
from dist_ckpt.discovery import CheckpointInfo, TornCheckpointWarning, latest, list_checkpoints
from dist_ckpt.errors import (
    BackgroundSaveError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    TreeMismatchError,
)
from dist_ckpt.layout import read_manifest
from dist_ckpt.load import load
from dist_ckpt.save import save, wait
from dist_ckpt.writer import SaveJob

__all__ = [
    "BackgroundSaveError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "Checkpointer",
    "KeepPolicy",
    "SaveJob",
    "TornCheckpointWarning",
    "TreeMismatchError",
    "latest",
    "list_checkpoints",
    "load",
    "read_manifest",
    "save",
    "wait",
]
