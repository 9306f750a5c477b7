"""DoReMi's proxy objective: excess losses against the frozen reference, the weight update, and the weighted loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm_models import inference_mode, next_token_loss, next_token_targets
from lm_train.post.doremi.weights import DomainWeights, excess_losses, per_domain_means, updated_weights
from lm_train.run.batch import TokenBatch


def doremi_objective(names: Sequence[str], trained: Sequence[bool], step_size: float, smoothing: float):
    """The proxy's `Objective`: (model, batch, key, frozen reference, DomainWeights) -> (loss, metrics, next
    DomainWeights).

    The batch carries each example's domain (`extra["source_ids"]`, an index into `names`). The weights are
    updated first from this batch's excess losses (no gradient flows through them), then the proxy minimises the
    sum over domains of weight times its mean token loss: Algorithm 1 of Xie et al. 2023.
    """
    trained_mask = np.asarray(trained, bool)
    domains = len(names)

    def objective(
        model: Any, batch: TokenBatch, key: jax.Array | None, frozen: Any = None, kind_state: Any = None
    ) -> tuple[jax.Array, dict[str, jax.Array], DomainWeights]:
        source_ids = batch.extra.get("source_ids")
        if source_ids is None:
            raise ValueError("a DoReMi batch needs source_ids: the domain of each example")
        if frozen is None or not isinstance(kind_state, DomainWeights):
            raise ValueError("DoReMi's objective needs the frozen reference model and the DomainWeights state")
        _, not_last = next_token_targets(batch.input_ids)
        mask = jnp.broadcast_to(not_last.array, batch.input_ids.array.shape)
        domain_ids = source_ids.array
        proxy = next_token_loss(model, batch.input_ids, key=key, reduction=None).array
        reference = next_token_loss(inference_mode(frozen), batch.input_ids, reduction=None).array
        excess = excess_losses(
            jax.lax.stop_gradient(proxy), jax.lax.stop_gradient(reference), mask, domain_ids, domains
        )
        weights = updated_weights(kind_state.weights, excess, jnp.asarray(trained_mask), step_size, smoothing)
        domain_loss = per_domain_means(proxy, mask, domain_ids, domains)
        loss = jnp.sum(jax.lax.stop_gradient(weights) * domain_loss)
        metrics: dict[str, jax.Array] = {}
        for i, name in enumerate(names):
            if trained_mask[i]:
                metrics[f"doremi/{name}/weight"] = weights[i]
                metrics[f"doremi/{name}/excess_loss"] = excess[i]
        next_state = DomainWeights(weights=weights, weight_sum=kind_state.weight_sum + weights)
        return loss, metrics, next_state

    return objective
