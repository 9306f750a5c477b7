"""DoReMi's domain weights: per-domain excess losses and the exponentiated-gradient update, in plain jax.numpy.

Xie et al. 2023, Algorithm 1: with per-token losses of the proxy and the reference, each domain's excess loss
is the mean over its tokens of max(proxy - reference, 0); the weights step to w * exp(step_size * excess),
renormalised, then smoothed towards uniform: (1 - smoothing) * w + smoothing * uniform.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


class DomainWeights(eqx.Module):
    """The weights in force (domains,) and their sum over the steps so far (the average is sum / steps)."""

    weights: jax.Array
    weight_sum: jax.Array


def initial_domain_weights(trained: jax.Array) -> DomainWeights:
    """Uniform over the trained domains (0 for evaluation-only ones), and an empty running sum."""
    uniform = trained.astype(jnp.float32) / jnp.sum(trained.astype(jnp.float32))
    return DomainWeights(weights=uniform, weight_sum=jnp.zeros_like(uniform))


def per_domain_means(token_values: jax.Array, token_mask: jax.Array, domain_ids: jax.Array, domains: int) -> jax.Array:
    """(domains,): the mean of token_values (batch, position) over each domain's counted tokens; 0 for a domain
    with none in the batch."""
    mask = token_mask.astype(jnp.float32)
    per_example = jnp.sum(token_values.astype(jnp.float32) * mask, axis=1)
    tokens = jnp.sum(mask, axis=1)
    one_hot = jax.nn.one_hot(domain_ids, domains, dtype=jnp.float32)  # (batch, domains)
    sums, counts = per_example @ one_hot, tokens @ one_hot
    return jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)


def excess_losses(
    proxy_nll: jax.Array, reference_nll: jax.Array, token_mask: jax.Array, domain_ids: jax.Array, domains: int
) -> jax.Array:
    """(domains,): each domain's mean per-token excess loss, proxy minus reference clipped at 0."""
    excess = jnp.maximum(proxy_nll.astype(jnp.float32) - reference_nll.astype(jnp.float32), 0.0)
    return per_domain_means(excess, token_mask, domain_ids, domains)


def updated_weights(
    weights: jax.Array, excess: jax.Array, trained: jax.Array, step_size: float, smoothing: float
) -> jax.Array:
    """The next weights: exponentiated gradient ascent on the excess losses, renormalised, smoothed to uniform."""
    trained = trained.astype(jnp.float32)
    # Shifting the exponent by its largest value leaves the normalised result unchanged and cannot overflow.
    exponent = step_size * excess
    scaled = weights * jnp.exp(exponent - jnp.max(jnp.where(trained > 0, exponent, -jnp.inf)))
    stepped = scaled / jnp.sum(scaled)
    return (1.0 - smoothing) * stepped + smoothing * trained / jnp.sum(trained)


def average_weights(state: DomainWeights, steps: int) -> jax.Array:
    """The weights averaged over the steps taken (what DoReMi hands to the full run)."""
    return state.weight_sum / max(steps, 1)
