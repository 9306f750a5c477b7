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


def _split_along(leaf: Any, array: jax.Array, split_axis: str | None) -> list[tuple[str, jax.Array]]:
    """(suffix, values) pairs: one per index of the named `split_axis` when the leaf has it, else the whole leaf."""
    names = [getattr(axis, "name", None) for axis in getattr(leaf, "axes", ())] if _is_named_array(leaf) else []
    if split_axis is None or split_axis not in names:
        return [("", array.reshape(-1))]
    rows = jnp.moveaxis(array, names.index(split_axis), 0).reshape(array.shape[names.index(split_axis)], -1)
    return [(f"/layer_{i}", rows[i]) for i in range(rows.shape[0])]


def summarize_tree(
    tree: Any,
    prefix: str,
    *,
    bins: int | None = 32,
    per_leaf: bool = True,
    include_max: bool = True,
    split_axis: str | None = None,
) -> dict[str, jax.Array | Histogram]:
    """Metrics for every floating-point leaf of `tree`, jit-compatible, ready for `jit_log`.

    Keys: `{prefix}/norm/total` (global L2 norm), and per leaf (unless `per_leaf` is False)
    `{prefix}/norm/{path}` (L2 norm), `{prefix}/max/{path}` (largest absolute value, if `include_max`) and, unless
    `bins` is None, `{prefix}/hist/{path}`. `path` joins the leaf's dict keys, attribute names and indices with '/'.
    Integer leaves are skipped. With `split_axis`, a NamedArray-like leaf that has an axis of that name (a scanned
    layer stack's `layers`) is reported per index of it, as `{path}/layer_{i}`.
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
        name = "/".join(_key_name(key) for key in path) or "value"
        for suffix, part in _split_along(leaf, array.astype(jnp.float32), split_axis):
            squares = jnp.sum(part * part)
            total_squares = total_squares + squares
            if not per_leaf:
                continue
            metrics[f"{prefix}/norm/{name}{suffix}"] = jnp.sqrt(squares)
            if include_max:
                metrics[f"{prefix}/max/{name}{suffix}"] = jnp.max(jnp.abs(part))
            if bins is not None:
                metrics[f"{prefix}/hist/{name}{suffix}"] = _histogram(part, bins)
    return {f"{prefix}/norm/total": jnp.sqrt(total_squares), **metrics}
