"""A mixture of experts' router in the train step: the experts' load summarised, and the balance bias moved and
logged."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import named_tensors as nt
import trackers

ROUTER_LOAD = "router/load"
"""The objective's metric holding the sparse layers' raw expert loads (layers, experts); the step summarises it."""
HISTOGRAM_BINS = 16


def router_load_metrics(load: jax.Array) -> dict[str, Any]:
    """Scalars (and one histogram) that summarise the expert loads (layers, experts), each row summing to one.

    router/load_max and router/load_min: the largest and smallest share of a layer's routed choices that one
    expert took (1/experts when balanced); router/load_cv: the mean over layers of the coefficient of variation
    of the experts' loads (0 when balanced); router/load_hist: a histogram of every layer's per-expert loads.
    """
    load = load.astype(jnp.float32)
    per_layer_cv = jnp.std(load, axis=-1) / jnp.mean(load, axis=-1)
    flat = load.reshape(-1)
    counts, edges = jnp.histogram(flat, bins=HISTOGRAM_BINS, range=(0.0, 1.0))
    histogram = trackers.Histogram(
        edges=edges,
        counts=counts,
        min=jnp.min(flat),
        max=jnp.max(flat),
        num=jnp.asarray(flat.size, jnp.float32),
        sum=jnp.sum(flat),
        sum_squares=jnp.sum(flat * flat),
    )
    return {
        "router/load_max": jnp.max(flat),
        "router/load_min": jnp.min(flat),
        "router/load_cv": jnp.mean(per_layer_cv),
        "router/load_hist": histogram,
    }


def balance_bias_metrics(biases: list[jax.Array]) -> dict[str, jax.Array]:
    """router/balance_bias_max, _min and _abs_mean over every sparse layer's correction bias."""
    flat = jnp.concatenate([b.astype(jnp.float32).reshape(-1) for b in biases])
    return {
        "router/balance_bias_max": jnp.max(flat),
        "router/balance_bias_min": jnp.min(flat),
        "router/balance_bias_abs_mean": jnp.mean(jnp.abs(flat)),
    }


def balance_routing(new_params: Any, params: Any, load: jax.Array | None) -> tuple[Any, dict[str, jax.Array]]:
    """The updated parameters with each sparse layer's correction bias moved toward balance from its `load`
    (DeepSeek-V3's aux-loss-free balancing), and the biases' metrics; unchanged and {} where the model does not
    balance. Decided when tracing: switched off, the step is unchanged."""
    # The trainable partition of the model (its frozen weights None); with LoRA it holds no routing biases.
    balances = getattr(new_params, "balances_routing", None)
    if load is None or not (balances and balances()) or any(b is None for b in new_params.routing_biases()):
        return new_params, {}
    new_params = nt.shard(new_params.balance_routing(params, load))
    return new_params, balance_bias_metrics([b.array for b in new_params.routing_biases()])
