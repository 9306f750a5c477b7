"""A parameter seen as a batch of blocks, (B, *block): the layout that SOAP and Kron share."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

import named_tensors as nt

BATCH_AXES = ("layers",)
"""Named axes that hold separate parameters (a stack of layers), never a dimension of one."""


@dataclass(frozen=True)
class BlockView:
    """How one parameter is viewed as a batch of blocks: (B, *block) with B = layers x blocks (static)."""

    order: tuple[int, ...]
    """The permutation that puts the batch axes first."""
    batch: tuple[int, ...]
    """Sizes of the batch axes (e.g. layers)."""
    merged: tuple[int, ...]
    """The other dimensions after merging small neighbours."""
    blocks: tuple[int, ...]
    """How many blocks each merged dimension is cut into (1: not cut)."""

    @property
    def block(self) -> tuple[int, ...]:
        """The shape of one block."""
        return tuple(d // n for d, n in zip(self.merged, self.blocks, strict=True))

    @property
    def count(self) -> int:
        """B: how many blocks, layers included."""
        return math.prod(self.batch) * math.prod(self.blocks)

    def to_blocks(self, x: jax.Array) -> jax.Array:
        """The parameter-shaped x as (B, *block)."""
        k = len(self.merged)
        x = jnp.transpose(x, self.order).reshape(*self.batch, *self.merged)
        x = x.reshape(*self.batch, *(s for n, b in zip(self.blocks, self.block, strict=True) for s in (n, b)))
        nb = len(self.batch)
        x = jnp.transpose(x, (*range(nb), *(nb + 2 * i for i in range(k)), *(nb + 2 * i + 1 for i in range(k))))
        return x.reshape(self.count, *self.block)

    def from_blocks(self, x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """The inverse of to_blocks, back to a parameter of `shape`."""
        k, nb = len(self.merged), len(self.batch)
        x = x.reshape(*self.batch, *self.blocks, *self.block)
        interleave = [nb + i for j in range(k) for i in (j, k + j)]
        x = jnp.transpose(x, (*range(nb), *interleave))
        x = x.reshape(*self.batch, *(shape[i] for i in self.order[nb:]))
        inverse = [0] * len(self.order)
        for position, axis in enumerate(self.order):
            inverse[axis] = position
        return jnp.transpose(x, inverse)


def leaves(tree: Any) -> tuple[list[Any], Any]:
    """A tree's leaves, a named array counting as one leaf, and its treedef."""
    return jax.tree_util.tree_flatten(tree, is_leaf=nt.is_named)


def raw(x: Any) -> jax.Array:
    """The jax array of a leaf, named or not."""
    return x.array if nt.is_named(x) else x


def split_batch_axes(leaf: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(order, batch sizes, the other dimensions) of a NamedArray (its `layers` axis a batch) or a plain array."""
    shape = tuple(leaf.array.shape if nt.is_named(leaf) else leaf.shape)
    names = leaf.axis_names if nt.is_named(leaf) else (None,) * len(shape)
    batch_positions = tuple(i for i, n in enumerate(names) if n in BATCH_AXES)
    rest = tuple(i for i in range(len(shape)) if i not in batch_positions)
    return batch_positions + rest, tuple(shape[i] for i in batch_positions), tuple(shape[i] for i in rest)


def merge_dims(dims: tuple[int, ...], target: int) -> tuple[int, ...]:
    """Neighbouring dimensions merged, left to right, while their product stays <= target."""
    merged: list[int] = []
    for d in dims:
        if merged and merged[-1] * d <= target:
            merged[-1] *= d
        else:
            merged.append(d)
    return tuple(merged)
