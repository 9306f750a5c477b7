"""Training objectives: what the train step differentiates, given the model in its compute dtype and a batch.

An objective returns the scalar loss and a dict of scalar metrics it wants logged (averaged over
microbatches). Post-training objectives (DPO, ...) are other functions of the same shape; the step knows none
by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import next_token_loss
from lm_train.batch import TokenBatch

Objective = Callable[[Any, TokenBatch, jax.Array | None], tuple[jax.Array, dict[str, jax.Array]]]
"""(model, batch, dropout key) -> (loss, metrics)."""


def next_token_objective(z_loss_weight: float = 0.0) -> Objective:
    """Language-model pretraining and SFT: mean next-token cross-entropy over the tokens the batch scores."""

    def objective(model: Any, batch: TokenBatch, key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss = next_token_loss(model, batch.input_ids, key=key, z_loss_weight=z_loss_weight, **batch.loss_inputs())
        loss = loss.array if isinstance(loss, nt.NamedArray) else loss
        return loss.astype(jnp.float32), {}

    return objective
