"""Pytree utilities that treat a NamedArray as one leaf: maps, parameter counts, filters, partition."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._core import AxisSelector, axis_name, is_named


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """jax.tree.map that hands each NamedArray to `fn` whole (not its underlying array)."""

    def leaf(x: Any) -> bool:
        return is_named(x) or (is_leaf is not None and is_leaf(x))

    return jax.tree.map(fn, tree, *rest, is_leaf=leaf)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a tree, each NamedArray as one leaf."""
    return jax.tree.leaves(tree, is_leaf=is_named)


def _array_of(x: Any) -> Any:
    return x.array if is_named(x) else x


def count_parameters(tree: Any, filter: Callable[[Any], bool] | None = None) -> int:
    """The number of floating-point scalars in `tree` (or in the leaves `filter` selects)."""
    total = 0
    for path, leaf in _leaves_with_paths(tree):
        if filter is None:
            if not is_floating(path, leaf):
                continue
        elif not _as_filter(filter)(path, leaf):
            continue
        array = _array_of(leaf)
        if eqx.is_array(array):
            total += int(array.size)
    return total


class Filter:
    """A predicate on (dotted path, leaf); filters combine with &, | and ~."""

    def __init__(self, fn: Callable[[str, Any], object], description: str):  # its result is taken as a bool
        self._fn = fn
        self.description = description

    def __call__(self, path: str, leaf: Any) -> bool:
        return bool(self._fn(path, leaf))

    def __and__(self, other: Any) -> Filter:
        other = _as_filter(other)
        return Filter(lambda p, x: self(p, x) and other(p, x), f"({self.description} & {other.description})")

    def __or__(self, other: Any) -> Filter:
        other = _as_filter(other)
        return Filter(lambda p, x: self(p, x) or other(p, x), f"({self.description} | {other.description})")

    def __invert__(self) -> Filter:
        return Filter(lambda p, x: not self(p, x), f"~{self.description}")

    def __repr__(self) -> str:
        return f"Filter({self.description})"


def _as_filter(f: Any) -> Filter:
    if isinstance(f, Filter):
        return f
    if callable(f):
        return Filter(lambda _path, leaf: f(leaf), getattr(f, "__name__", repr(f)))
    raise TypeError(f"A filter is an nt.Filter or a callable leaf -> bool, got {f!r}")


def _floating(_path: str, leaf: Any) -> bool:
    array = _array_of(leaf)
    return eqx.is_array(array) and jnp.issubdtype(array.dtype, jnp.floating)


is_floating = Filter(_floating, "is_floating")


def with_axis(*axes: AxisSelector) -> Filter:
    """Selects NamedArrays that have any of the given axes (by name)."""
    if not axes:
        raise ValueError("with_axis needs at least one axis name")
    names = {axis_name(a) for a in axes}
    return Filter(lambda _p, x: is_named(x) and bool(names & set(x.axis_names)), f"with_axis{sorted(names)}")


def path_matches(pattern: str) -> Filter:
    """Selects leaves whose dotted path (e.g. 'blocks.stacked.attn.w_q') contains a match of `pattern`."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"path_matches: invalid regular expression {pattern!r}: {e}") from None
    return Filter(lambda p, _x: compiled.search(p) is not None, f"path_matches({pattern!r})")


def _key_str(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: tuple) -> str:
    """A jax key path as a dotted string: attributes, dict keys and indices joined by '.'."""
    return ".".join(_key_str(k) for k in path)


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named)
    return [(path_str(p), leaf) for p, leaf in flat]


def mask(tree: Any, filter: Filter | Callable[[Any], bool]) -> Any:
    """A tree of bools, one per leaf (one per NamedArray), true where `filter` selects; for optax masks."""
    f = _as_filter(filter)
    return jax.tree_util.tree_map_with_path(lambda p, x: f(path_str(p), x), tree, is_leaf=is_named)


def partition(tree: Any, filter: Filter | Callable[[Any], bool]) -> tuple[Any, Any]:
    """Split `tree` into (selected, rest): each keeps its own leaves and has None in place of the other's."""
    f = _as_filter(filter)
    flags = mask(tree, f)
    selected = jax.tree.map(lambda keep, x: x if keep else None, flags, tree, is_leaf=is_named)
    rest = jax.tree.map(lambda keep, x: None if keep else x, flags, tree, is_leaf=is_named)
    return selected, rest


def combine(*trees: Any) -> Any:
    """Merge trees from `partition`: each leaf is taken from the first tree that has it (not None)."""
    if not trees:
        raise ValueError("combine needs at least one tree")

    def first(*leaves: Any) -> Any:
        for leaf in leaves:
            if leaf is not None:
                return leaf
        return None

    return jax.tree.map(first, *trees, is_leaf=lambda x: x is None or is_named(x))


__all__ = [
    "Filter",
    "combine",
    "count_parameters",
    "is_floating",
    "mask",
    "partition",
    "path_matches",
    "path_str",
    "tree_leaves",
    "tree_map",
    "with_axis",
]
