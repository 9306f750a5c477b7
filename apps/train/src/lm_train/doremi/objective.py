"""DoReMi's proxy objective: excess losses against the frozen reference, the weight update, and the weighted loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm_models import inference_mode, next_token_loss, next_token_targets
from lm_train.batch import TokenBatch
from lm_train.doremi.weights import DomainWeights, excess_losses, per_domain_means, updated_weights


def doremi_objective(names: Sequence[str], trained: Sequence[bool], step_size: float, smoothing: float):
    """(model, batch, key, *, reference, objective_state) -> (loss, metrics, next DomainWeights).

    The batch carries each example's domain (`source_ids`, an index into `names`). The weights are updated first
    from this batch's excess losses (no gradient flows through them), then the proxy minimises the sum over
    domains of weight times its mean token loss: Algorithm 1 of Xie et al. 2023.
    """
    trained_mask = np.asarray(trained, bool)
    domains = len(names)

    def objective(
        model: Any, batch: TokenBatch, key: jax.Array | None, *, reference: Any, objective_state: DomainWeights
    ) -> tuple[jax.Array, dict[str, jax.Array], DomainWeights]:
        if batch.source_ids is None:
            raise ValueError("a DoReMi batch needs source_ids: the domain of each example")
        _, not_last = next_token_targets(batch.input_ids)
        mask = jnp.broadcast_to(not_last.array, batch.input_ids.array.shape)
        domain_ids = batch.source_ids.array
        proxy = next_token_loss(model, batch.input_ids, key=key, reduction=None).array
        frozen = next_token_loss(inference_mode(reference), batch.input_ids, reduction=None).array
        excess = excess_losses(jax.lax.stop_gradient(proxy), jax.lax.stop_gradient(frozen), mask, domain_ids, domains)
        weights = updated_weights(objective_state.weights, excess, jnp.asarray(trained_mask), step_size, smoothing)
        domain_loss = per_domain_means(proxy, mask, domain_ids, domains)
        loss = jnp.sum(jax.lax.stop_gradient(weights) * domain_loss)
        metrics: dict[str, jax.Array] = {}
        for i, name in enumerate(names):
            if trained_mask[i]:
                metrics[f"doremi/{name}/weight"] = weights[i]
                metrics[f"doremi/{name}/excess_loss"] = excess[i]
        next_state = DomainWeights(weights=weights, weight_sum=objective_state.weight_sum + weights)
        return loss, metrics, next_state

    return objective
