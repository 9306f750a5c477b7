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
"""(model, batch, dropout key) -> (loss, metrics). When the state holds a frozen reference model (DPO), the step
also passes it, as `reference=`."""


def next_token_objective(z_loss_weight: float = 0.0) -> Objective:
    """Language-model pretraining and SFT: mean next-token cross-entropy over the tokens the batch scores.

    A model with auxiliary losses (a mixture of experts' router load-balancing and z-losses) adds each, times
    its weight in the model config (Mixtral's `lbl_coef`, `rzl_coef`), to the loss it optimises, and logs each
    unweighted as `train/<name>` (`train/router_aux_loss`, `train/router_z_loss`). The choice is made when
    the step is traced, from the config: a dense model's step is the plain cross-entropy, as before.
    """

    def objective(model: Any, batch: TokenBatch, key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        inputs = batch.loss_inputs()
        if not model.config.aux_loss_weights():
            loss = next_token_loss(model, batch.input_ids, key=key, z_loss_weight=z_loss_weight, **inputs)
            return _scalar(loss), {}
        loss, aux = next_token_loss(
            model, batch.input_ids, key=key, z_loss_weight=z_loss_weight, with_aux=True, **inputs
        )
        return _scalar(loss), {f"train/{name}": value.astype(jnp.float32) for name, value in aux.items()}

    return objective


def _scalar(loss: Any) -> jax.Array:
    loss = loss.array if isinstance(loss, nt.NamedArray) else loss
    return loss.astype(jnp.float32)
