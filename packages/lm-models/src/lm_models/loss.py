"""The causal-LM objective: cross-entropy of each next token, from named-tensors' cross-entropy losses."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import NamedArray

from .model import POSITION, LmHeadModel


def next_token_targets(input_ids: NamedArray) -> tuple[NamedArray, NamedArray]:
    """Targets (the id at t + 1 for each position t) and a mask that is False at the last position."""
    Pos = input_ids.resolve_axis(POSITION)
    targets = nt.roll(input_ids, -1, POSITION)
    not_last = nt.arange(Pos, dtype=jnp.int32) < Pos.size - 1
    return targets, not_last


def next_token_loss(
    model: LmHeadModel,
    input_ids: NamedArray,
    *,
    loss_mask: NamedArray | None = None,
    attn_mask: NamedArray | None = None,
    positions: NamedArray | None = None,
    key: jax.Array | None = None,
    reduction: Literal["mean", "sum"] | None = "mean",
    z_loss_weight: float = 0.0,
    blockwise: bool = False,
    block_size: int = 2048,
) -> NamedArray:
    """Cross-entropy of predicting input_ids[t + 1] at every position t; the last position is not scored.

    loss_mask (bool or float weights, over input_ids' axes or a subset) weights the prediction made AT each
    position, so loss_mask[t] = 0 drops the loss of predicting token t + 1. "mean" divides by the total
    weight of the scored positions. blockwise=True scores the vocabulary in chunks of `block_size` from the
    final hidden states, so the full (position, vocab) float32 logits never exist at once.
    attn_mask (True = may attend) is combined with the causal mask, and `positions` replaces each token's
    position, as in the model call (for packed sequences: nt.nn.packed_causal_mask and restarting positions).
    """
    extra = {} if positions is None else {"positions": positions}
    targets, mask = next_token_targets(input_ids)
    if loss_mask is not None:
        mask = mask & loss_mask if loss_mask.dtype == jnp.bool_ else mask.astype(loss_mask.dtype) * loss_mask
    if not blockwise:
        logits = model(input_ids, attn_mask, key=key, **extra)
        return nt.nn.cross_entropy_loss(
            logits, model.Vocab, targets, mask=mask, reduction=reduction, z_loss_weight=z_loss_weight
        )
    hidden, _ = model.activations(input_ids, attn_mask, key=key, **extra)
    head = model.unembedding().astype(hidden.dtype)
    return nt.nn.blockwise_cross_entropy_loss(
        hidden,
        head,
        model.config.Embed,
        model.Vocab,
        targets,
        mask=mask,
        reduction=reduction,
        z_loss_weight=z_loss_weight,
        block_size=block_size,
    )
