"""Training objectives: what the train step differentiates, given the model in its compute dtype and a batch.

Every objective has the one signature `Objective` states: it returns the scalar loss, a dict of scalar metrics it
wants logged (averaged over microbatches) and the kind's next state. A kind of training (lm_train.run.training_kind)
brings its own objective of that signature; the step knows none by name.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import next_token_loss
from lm_train.run.batch import TokenBatch
from lm_train.run.router_metrics import ROUTER_LOAD

Metrics = dict[str, jax.Array]


class Objective(Protocol):
    """What the step differentiates: (model, batch, dropout key, frozen, kind_state) -> (loss, metrics, kind_state).

    `model` is in the compute dtype; `key` is None in evaluation; `frozen` is the state's frozen model (compute
    dtype, no gradients) or None; `kind_state` is the state's checkpointed kind state or None, and the objective
    returns its next value (the same None when it has none). Only the loss is differentiated.
    """

    def __call__(
        self, model: Any, batch: TokenBatch, key: jax.Array | None, frozen: Any = None, kind_state: Any = None
    ) -> tuple[jax.Array, Metrics, Any]: ...


FCM_PURPOSE = 0x46434D  # folded into the step's dropout key: the forgetful-causal-mask draw has its own stream


def with_forgetful_mask(batch: TokenBatch, inputs: dict[str, Any], fcm_prob: float, key: jax.Array | None) -> None:
    """Add forgetful causal masking (fcm_prob > 0, training only) to the attention mask of `inputs`, in place."""
    if not fcm_prob or key is None:
        return
    Pos = batch.input_ids.resolve_axis("position")
    examples = tuple(a for a in batch.input_ids.axes if a.name != Pos.name)
    keep = nt.nn.forgetful_causal_mask(
        Pos.alias("key_position"), fcm_prob, key=jax.random.fold_in(key, FCM_PURPOSE), batch_axes=examples
    )
    inputs["attn_mask"] = nt.nn.and_masks(inputs.get("attn_mask"), keep)


def next_token_objective(z_loss_weight: float = 0.0, fcm_prob: float = 0.0) -> Objective:
    """Language-model pretraining and SFT: mean next-token cross-entropy over the tokens the batch scores.

    A model with auxiliary losses (a mixture of experts' router load-balancing and z-losses) adds each, times
    its weight in the model config (Mixtral's `lbl_coef`, `rzl_coef`), to the loss it optimises, and logs each
    unweighted as `train/<name>` (`train/router_aux_loss`, `train/router_z_loss`). The choice is made when
    the step is traced, from the config: a dense model's step is the plain cross-entropy, as before. A mixture
    also returns its sparse layers' expert loads as the metric `router/load` (layers, experts), which the step
    summarises (lm_train.run.router_metrics) and DeepSeek-V3's aux-loss-free balancing reads.
    With fcm_prob > 0, attention is also forgetful (Levanter's `fcm_prob`): eval and export never see it.
    """

    def objective(
        model: Any, batch: TokenBatch, key: jax.Array | None, frozen: Any = None, kind_state: Any = None
    ) -> tuple[jax.Array, Metrics, Any]:
        inputs = batch.loss_inputs()
        with_forgetful_mask(batch, inputs, fcm_prob, key)
        if not model.config.aux_loss_weights():
            loss = next_token_loss(model, batch.input_ids, key=key, z_loss_weight=z_loss_weight, **inputs)
            return _scalar(loss), {}, kind_state
        loss, aux = next_token_loss(
            model, batch.input_ids, key=key, z_loss_weight=z_loss_weight, with_aux=True, router_load=True, **inputs
        )
        load = aux.pop(nt.nn.ROUTER_LOAD, None)
        metrics = {f"train/{name}": value.astype(jnp.float32) for name, value in aux.items()}
        if load is not None:
            metrics[ROUTER_LOAD] = load
        return _scalar(loss), metrics, kind_state

    return objective


def _scalar(loss: Any) -> jax.Array:
    loss = loss.array if isinstance(loss, nt.NamedArray) else loss
    return loss.astype(jnp.float32)
