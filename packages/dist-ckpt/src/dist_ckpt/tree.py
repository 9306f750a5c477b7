"""Flattening pytrees into named leaves: key paths, leaf kinds and file-system-safe array names."""

import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

# Python values that round-trip through JSON exactly (floats via repr, NaN and inf included).
SCALAR_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class Leaf:
    """One leaf of a flattened tree: its printable key path, its key path entries and its value."""

    path: str
    keys: tuple[Any, ...]
    value: Any


def flatten(tree: Any) -> tuple[list[Leaf], Any]:
    """Flatten `tree` into leaves in jax's order (None subtrees hold no leaf) and its treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [Leaf(jax.tree_util.keystr(keys), tuple(keys), value) for keys, value in pairs], treedef


def is_prng_key_array(value: Any) -> bool:
    """True for typed jax PRNG key arrays (dtype key<...>), which have no storable bytes of their own."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def leaf_kind(leaf: Leaf) -> str:
    """Classify a leaf to save: 'jax' (jax.Array), 'numpy' (numpy array or scalar) or 'scalar' (Python)."""
    value = leaf.value
    if is_prng_key_array(value):
        raise TypeError(
            f"Leaf {leaf.path} is a typed PRNG key array ({value.dtype}), which has no stable bytes to "
            "save. Save jax.random.key_data(key) instead and rebuild the key with "
            "jax.random.wrap_key_data(data) after loading."
        )
    if isinstance(value, jax.Array):
        return "jax"
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype.kind == "O":
            raise TypeError(
                f"Leaf {leaf.path} is a numpy array of Python objects, which cannot be saved as an array. "
                "Convert it to a numeric dtype, or make it a static (non-leaf) field of its module."
            )
        return "numpy"
    if isinstance(value, SCALAR_TYPES):
        return "scalar"
    raise TypeError(
        f"Leaf {leaf.path} has type {type(value).__name__}, which dist_ckpt cannot save: leaves must be "
        "jax arrays, numpy arrays, or Python bool/int/float/str. Mark it static (e.g. an equinox "
        "field(static=True)), remove it from the tree, or convert it to an array."
    )


def _key_name(key: Any) -> str:
    """The bare name of one key path entry (a dict key, attribute name or index)."""
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def array_names(leaves: list[Leaf]) -> list[str]:
    """A unique, file-system-safe directory name per leaf, readable from its key path (e.g. 'params.w')."""
    names: list[str] = []
    taken: set[str] = set()
    for leaf in leaves:
        parts = [re.sub(r"[^A-Za-z0-9_\-]+", "_", _key_name(key)) or "_" for key in leaf.keys]
        base = ".".join(parts)[:150] or "root"
        name, suffix = base, 1
        while name.lower() in taken:  # lower(): case-insensitive file systems must not merge two leaves
            suffix += 1
            name = f"{base}~{suffix}"
        taken.add(name.lower())
        names.append(name)
    return names
