"""Norms, largest magnitudes and histograms of a pytree of arrays (gradients, parameters, updates)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from trackers.histogram import Histogram


def _is_named_array(node: Any) -> bool:
    # NamedArray-like leaves (named_tensors) carry their data in `.array`; trackers does not import them.
    return hasattr(node, "array") and hasattr(node, "axes")


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _histogram(values: jax.Array, bins: int) -> Histogram:
    counts, edges = jnp.histogram(values, bins=bins)
    return Histogram(
        edges=edges,
        counts=counts,
        min=jnp.min(values),
        max=jnp.max(values),
        num=jnp.asarray(values.size, dtype=jnp.float32),
        sum=jnp.sum(values),
        sum_squares=jnp.sum(values * values),
    )


def summarize_tree(tree: Any, prefix: str, *, bins: int | None = 32) -> dict[str, jax.Array | Histogram]:
    """Metrics for every floating-point leaf of `tree`, jit-compatible, ready for `jit_log`.

    Keys: `{prefix}/norm/total` (global L2 norm), and per leaf `{prefix}/norm/{path}` (L2 norm),
    `{prefix}/max/{path}` (largest absolute value) and, unless `bins` is None, `{prefix}/hist/{path}`.
    `path` joins the leaf's dict keys, attribute names and indices with '/'. Integer leaves are skipped.
    """
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_named_array)[0]
    metrics: dict[str, jax.Array | Histogram] = {}
    total_squares = jnp.zeros((), dtype=jnp.float32)
    for path, leaf in leaves_with_paths:
        array = leaf.array if _is_named_array(leaf) else leaf
        if not isinstance(array, jax.Array | jax.ShapeDtypeStruct) and not hasattr(array, "__array__"):
            continue
        array = jnp.asarray(array)
        if not jnp.issubdtype(array.dtype, jnp.floating) or array.size == 0:
            continue
        values = array.astype(jnp.float32).reshape(-1)
        name = "/".join(_key_name(key) for key in path) or "value"
        squares = jnp.sum(values * values)
        total_squares = total_squares + squares
        metrics[f"{prefix}/norm/{name}"] = jnp.sqrt(squares)
        metrics[f"{prefix}/max/{name}"] = jnp.max(jnp.abs(values))
        if bins is not None:
            metrics[f"{prefix}/hist/{name}"] = _histogram(values, bins)
    return {f"{prefix}/norm/total": jnp.sqrt(total_squares), **metrics}
