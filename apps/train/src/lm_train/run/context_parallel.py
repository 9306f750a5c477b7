"""Context parallelism's share of a run: its config checks, and the causal load balance of a batch's positions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

import named_tensors as nt
from lm_models import next_token_targets
from lm_train.config.trainer_config import TrainerConfig
from lm_train.errors import ConfigError
from lm_train.run.batch import TokenBatch

if TYPE_CHECKING:
    from lm_train.config.schema import TrainLmConfig

POSITION = "position"
# Families whose attention cannot go round the ring: ALiBi biases by key index (MPT), and Backpack's sense
# attention is its own layer; neither takes the `positions` that travel with the load-balanced tokens.
NO_RING = ("mpt", "backpack")


def context_size(trainer: TrainerConfig) -> int:
    """Devices that split each sequence: trainer.mesh's `context` when it gives one, else context_axis_size."""
    given = (trainer.mesh or {}).get("context")
    # A -1 in trainer.mesh is only known with the devices; the ring is right without the load balance then.
    return int(given) if given is not None and int(given) > 0 else trainer.context_axis_size


def check_context(config: TrainLmConfig) -> None:
    """Refuse, before anything compiles, a context-parallel run that cannot work, naming the key and the fix."""
    size = context_size(config.trainer)
    if size == 1:
        return
    model = config.model
    seq_len = getattr(model, "seq_len", None)
    if model.model_type in NO_RING:
        raise ConfigError(
            f"trainer.context_axis_size={size}: model.type {model.model_type} has no ring attention (ALiBi or sense "
            "attention); use a RoPE or learned-position family, or set trainer.context_axis_size to 1."
        )
    if seq_len is None or seq_len % (2 * size):
        raise ConfigError(
            f"trainer.context_axis_size={size} splits each sequence into {2 * size} chunks (two per device, for the "
            f"causal load balance), but model.seq_len={seq_len} is not a multiple of {2 * size}; choose a seq_len "
            "that is, or another context_axis_size."
        )
    if config.fcm_prob:
        raise ConfigError(
            f"fcm_prob={config.fcm_prob}: forgetful causal masking is an explicit mask that ring attention does not "
            f"take; set fcm_prob to 0 or trainer.context_axis_size (now {size}) to 1."
        )
    if getattr(model, "attn_pdrop", 0.0):
        raise ConfigError(
            f"model.attn_pdrop={model.attn_pdrop}: ring attention has no attention dropout; set it to 0 or "
            f"trainer.context_axis_size (now {size}) to 1."
        )


def balanced_order(length: int, size: int) -> np.ndarray:
    """The order of positions on a ring of `size` devices: device i holds chunks i and 2*size-1-i of 2*size.

    Under the causal rule a late chunk sees many keys and an early one few; pairing them gives every device the
    same work.
    """
    chunk = length // (2 * size)
    pairs = [(i, 2 * size - 1 - i) for i in range(size)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for pair in pairs for c in pair])


def load_balanced(batch: TokenBatch, size: int) -> TokenBatch:
    """The batch with its positions in the ring's balanced order; the targets are taken before the reordering.

    Each token keeps its position id (for RoPE and the causal rule), its segment id and its target, so the model
    computes the same per-token losses in another order, and a loss summed over positions is unchanged.
    """
    ids = batch.input_ids
    Pos = ids.resolve_axis(POSITION)
    order = jnp.asarray(balanced_order(Pos.size, size))
    targets, scored = next_token_targets(ids)
    if batch.loss_mask is not None:
        mask = batch.loss_mask
        scored = scored & mask if mask.dtype == jnp.bool_ else scored.astype(mask.dtype) * mask
    positions = batch.positions
    if positions is None:
        positions = nt.arange(Pos, dtype=jnp.int32).broadcast_to(ids.axes)

    def reorder(x: Any) -> Any:
        return None if x is None else nt.take(x, POSITION, nt.named(order, (Pos,)))

    return TokenBatch(
        reorder(ids),
        loss_mask=reorder(scored.broadcast_to(ids.axes)),
        segment_ids=reorder(batch.segment_ids),
        positions=reorder(positions),
        extra={name: reorder(x) if x.has_axis(POSITION) else x for name, x in batch.extra.items()},
        targets=reorder(targets),
    )


__all__ = ["balanced_order", "check_context", "context_size", "load_balanced"]
