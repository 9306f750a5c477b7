"""The DPO objective: sequence log-probs of the chosen and rejected responses under the policy and the frozen
reference, in the same step, and the loss -log sigmoid(beta * (policy log-ratio - reference log-ratio))."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_models import inference_mode, next_token_loss
from lm_train.run.batch import TokenBatch
from lm_train.run.objectives import Metrics, Objective

DPO_METRICS = (
    "dpo/accuracy",
    "dpo/reward_margin",
    "dpo/chosen_reward",
    "dpo/rejected_reward",
    "dpo/chosen_logp",
    "dpo/rejected_logp",
)
"""What the objective logs, each a mean over the batch's pairs (rewards are beta * (policy - reference) log-probs)."""


def sequence_log_probs(
    model: Any, input_ids: nt.NamedArray, loss_mask: nt.NamedArray, key: jax.Array | None = None
) -> jax.Array:
    """Per row (batch,): the sum of log p(token t + 1 | tokens ..t) over the positions t that loss_mask selects."""
    nll = next_token_loss(model, input_ids, loss_mask=loss_mask, key=key, reduction=None)  # 0 where masked
    return -nt.sum(nll, "position").array.astype(jnp.float32)


def dpo_loss(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    reference_chosen: jax.Array,
    reference_rejected: jax.Array,
    beta: float,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mean DPO loss over the valid pairs (all, when `valid` is None) and the DPO_METRICS; inputs are (pairs,)."""
    chosen_reward = beta * (policy_chosen - reference_chosen)
    rejected_reward = beta * (policy_rejected - reference_rejected)
    margin = chosen_reward - rejected_reward
    weight = jnp.ones_like(margin) if valid is None else valid.astype(jnp.float32)
    weight = weight / jnp.maximum(jnp.sum(weight), 1.0)  # a batch without a valid pair has loss 0, not NaN

    def mean(x: jax.Array) -> jax.Array:
        return jnp.sum(x.astype(jnp.float32) * weight)

    metrics = dict(
        zip(
            DPO_METRICS,
            (margin > 0, margin, chosen_reward, rejected_reward, policy_chosen, policy_rejected),
            strict=True,
        )
    )
    return mean(-jax.nn.log_sigmoid(margin)), {name: mean(value) for name, value in metrics.items()}


def dpo_objective(beta: float) -> Objective:
    """The step's objective for batches of pairs: input_ids/loss_mask (chosen), and in `extra`
    rejected_input_ids/rejected_loss_mask.

    The frozen reference (the state's `frozen`, passed by the step) scores the same sequences in the same step,
    without gradients and with dropout off. Each model runs on the chosen and the rejected rows separately, so no
    row moves between devices. A pair with no target in one of its sequences (a prompt that fills seq_len) counts
    for nothing.
    """

    def objective(
        model: Any, batch: TokenBatch, key: jax.Array | None, frozen: Any = None, kind_state: Any = None
    ) -> tuple[jax.Array, Metrics, Any]:
        rejected_ids, rejected_mask = batch.extra.get("rejected_input_ids"), batch.extra.get("rejected_loss_mask")
        if rejected_ids is None or batch.loss_mask is None or rejected_mask is None:
            raise ValueError("a DPO batch needs input_ids, loss_mask, rejected_input_ids and rejected_loss_mask")
        if frozen is None:
            raise ValueError("DPO's objective needs the frozen reference model (the state's `frozen`)")
        keys = (None, None) if key is None else (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))
        chosen = (batch.input_ids, batch.loss_mask)
        rejected = (rejected_ids, rejected_mask)
        policy_chosen = sequence_log_probs(model, *chosen, keys[0])
        policy_rejected = sequence_log_probs(model, *rejected, keys[1])
        reference = inference_mode(frozen)
        reference_chosen = jax.lax.stop_gradient(sequence_log_probs(reference, *chosen))
        reference_rejected = jax.lax.stop_gradient(sequence_log_probs(reference, *rejected))
        valid = nt.any(batch.loss_mask, "position").array & nt.any(rejected_mask, "position").array
        loss, metrics = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta, valid)
        return loss, metrics, kind_state

    return objective
