"""The names of the gradient-checkpointing policies of a layer stack (no jax, so that configs can check them)."""

from __future__ import annotations

from typing import Literal, TypeAlias

CheckpointPolicy: TypeAlias = Literal["none", "full", "save_block_outputs", "nested"]
CHECKPOINT_POLICIES: tuple[str, ...] = ("none", "full", "save_block_outputs", "nested")

# The name under which each block's output is tagged; the "save_block_outputs" policy keeps exactly these.
BLOCK_OUTPUT = "block_output"
