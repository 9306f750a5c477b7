"""vmap, scan and fold over a named axis.

Arguments are any pytrees (equinox Modules included). A NamedArray leaf that has the axis is mapped (or
scanned) over it, and the function sees it without that axis; NamedArrays without the axis and plain jax
arrays are passed whole to every call, unless `map_plain` says otherwise; other leaves (ints, strings,
functions) are passed through unchanged. On the way out, the axis is put back as the FIRST axis of every
NamedArray leaf, and plain jax arrays are stacked along their leading dimension.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._core import Axis, AxisSelector, NamedArray, _describe, axis_name, is_named

__all__ = ["fold", "scan", "vmap"]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


class _Split:
    """The leaves of a pytree, sorted into what is mapped, what is passed whole, and what is static."""

    def __init__(self, tree: Any, axis: str, plain_mapped: Sequence[bool], what: str):
        self.leaves, self.treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_named)
        self.dynamic: list[Any] = []  # raw arrays handed to the jax transformation
        self.positions: list[int | None] = []  # where each dynamic array carries the axis (None: unmapped)
        self.rebuild: list[Any] = []  # per leaf: ("named", axes), ("plain",) or ("static", value)
        self.sizes: list[tuple[str, int]] = []  # (description, size) of each mapped leaf, for errors
        for leaf, map_plain in zip(self.leaves, plain_mapped, strict=True):
            if isinstance(leaf, NamedArray):
                self.dynamic.append(leaf.array)
                if leaf.has_axis(axis):
                    i = leaf.axis_index(axis)
                    self.positions.append(i)
                    self.sizes.append((_describe(leaf.axes), leaf.axes[i].size))
                    self.rebuild.append(("named", leaf.axes[:i] + leaf.axes[i + 1 :]))
                else:
                    self.positions.append(None)
                    self.rebuild.append(("named", leaf.axes))
            elif _is_array(leaf):
                self.dynamic.append(leaf)
                if map_plain:
                    if np.ndim(leaf) == 0:
                        raise ValueError(f"{what}: a 0-d plain array cannot be mapped over axis {axis!r}")
                    self.positions.append(0)
                    self.sizes.append((f"plain array of shape {tuple(np.shape(leaf))}", np.shape(leaf)[0]))
                else:
                    self.positions.append(None)
                self.rebuild.append(("plain",))
            else:
                self.rebuild.append(("static", leaf))

    def length(self, axis: AxisSelector, what: str) -> int:
        """The common size of the mapped axis, with clear errors when there is none or they disagree."""
        name = axis_name(axis)
        found = {size for _, size in self.sizes}
        if isinstance(axis, Axis):
            found.add(axis.size)
        if not found:
            raise ValueError(
                f"{what}: no argument has axis {name!r}, so its size is unknown; pass an Axis "
                f"(with a size) instead of the name, or an argument with that axis"
            )
        if len(found) > 1:
            seen = [f"{d}" for d, _ in self.sizes]
            given = f"; asked for size {axis.size}" if isinstance(axis, Axis) else ""
            raise ValueError(f"{what}: axis {name!r} has different sizes in the arguments: {seen}{given}")
        return found.pop()

    def unflatten(self, dynamic: Sequence[Any]) -> Any:
        """The original tree with new dynamic arrays (slices, tracers) in place of the old ones."""
        it = iter(dynamic)
        leaves = []
        for kind in self.rebuild:
            if kind[0] == "named":
                leaves.append(NamedArray(next(it), kind[1]))
            elif kind[0] == "plain":
                leaves.append(next(it))
            else:
                leaves.append(kind[1])
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class _Outputs:
    """Splits a function's outputs into arrays (returned through jax) and static leaves (kept aside)."""

    def __init__(self) -> None:
        self.treedef = None
        self.rebuild: list[Any] = []

    def take_apart(self, tree: Any) -> list[Any]:
        leaves, self.treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_named)
        self.rebuild = []
        arrays = []
        for leaf in leaves:
            if isinstance(leaf, NamedArray):
                arrays.append(leaf.array)
                self.rebuild.append(("named", leaf.axes))
            elif _is_array(leaf) or isinstance(leaf, int | float | complex | bool):
                arrays.append(jnp.asarray(leaf))
                self.rebuild.append(("plain",))
            else:
                self.rebuild.append(("static", leaf))
        return arrays

    def put_together(self, arrays: Sequence[Any], mapped: Axis | None, what: str) -> Any:
        it = iter(arrays)
        leaves = []
        for kind in self.rebuild:
            if kind[0] == "named":
                if mapped is not None and any(a.name == mapped.name for a in kind[1]):
                    raise ValueError(
                        f"{what}: an output already has axis {mapped.name!r} {_describe(kind[1])}, so the "
                        "mapped axis cannot be put back on it; rename that output axis"
                    )
                axes = kind[1] if mapped is None else (mapped, *kind[1])
                leaves.append(NamedArray(next(it), axes))
            elif kind[0] == "plain":
                leaves.append(next(it))
            else:
                leaves.append(kind[1])
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _plain_flags(args: tuple, kwargs: dict, map_plain: Sequence[int | str]) -> list[bool]:
    """Per leaf of (args, kwargs): whether it belongs to an argument listed in map_plain."""
    for key in map_plain:
        if isinstance(key, int) and not 0 <= key < len(args):
            raise ValueError(f"map_plain: no positional argument {key}; the call has {len(args)}")
        if isinstance(key, str) and key not in kwargs:
            raise ValueError(f"map_plain: no keyword argument {key!r}; the call has {sorted(kwargs)}")
    wanted = set(map_plain)
    flags: list[bool] = []
    # Same leaf order as tree_flatten((args, kwargs)): positional first, then keywords in sorted order.
    for key, value in [*enumerate(args), *sorted(kwargs.items())]:
        flags += [key in wanted] * len(jax.tree_util.tree_leaves(value, is_leaf=is_named))
    return flags


def vmap(fn: Callable, axis: AxisSelector, *, map_plain: Sequence[int | str] = ()) -> Callable:
    """Vectorize fn over a named axis of its NamedArray arguments; outputs get that axis first.

    `map_plain` lists arguments (by position or keyword) whose plain jax arrays are mapped over their leading
    dimension too, e.g. a stack of PRNG keys for per-layer initialisation.
    """
    name = axis_name(axis)

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        flags = _plain_flags(args, kwargs, tuple(map_plain))
        inputs = _Split((args, kwargs), name, flags, "vmap")
        size = inputs.length(axis, "vmap")
        outputs = _Outputs()

        def per_slice(dynamic: list[Any]) -> list[Any]:
            call_args, call_kwargs = inputs.unflatten(dynamic)
            return outputs.take_apart(fn(*call_args, **call_kwargs))

        result = jax.vmap(per_slice, in_axes=(list(inputs.positions),), out_axes=0, axis_size=size)(inputs.dynamic)
        return outputs.put_together(result, Axis(name, size), "vmap")

    return mapped


def _scan(
    fn: Callable,
    axis: AxisSelector,
    reverse: bool,
    unroll: int | bool,
    remat: bool | Callable,
    map_plain: Sequence[int],
    what: str,
) -> Callable:
    name = axis_name(axis)

    @functools.wraps(fn)
    def run(init: Any, *xs: Any) -> tuple[Any, Any]:
        inputs = _Split(xs, name, _plain_flags(xs, {}, tuple(map_plain)), what)
        length = inputs.length(axis, what)
        scanned = [i for i, p in enumerate(inputs.positions) if p is not None]
        # lax.scan walks the leading dimension: bring the axis there for the scanned arrays only.
        leading = [jnp.moveaxis(inputs.dynamic[i], p, 0) for i, p in enumerate(inputs.positions) if p is not None]
        outputs = _Outputs()

        def step(carry: Any, sliced: list[Any]) -> tuple[Any, list[Any]]:
            dynamic = list(inputs.dynamic)
            for i, s in zip(scanned, sliced, strict=True):
                dynamic[i] = s
            new_carry, y = fn(carry, *inputs.unflatten(dynamic))
            return new_carry, outputs.take_apart(y)

        if callable(remat):
            step = jax.checkpoint(step, policy=remat)
        elif remat:
            step = jax.checkpoint(step)
        carry, ys = jax.lax.scan(step, init, leading, length=length, reverse=reverse, unroll=unroll)
        return carry, outputs.put_together(ys, Axis(name, length), what)

    return run


def scan(
    fn: Callable,
    axis: AxisSelector,
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
    remat: bool | Callable = False,
    map_plain: Sequence[int] = (),
) -> Callable:
    """`scan(fn, axis)(init, *xs)`: loop fn(carry, *x_slices) -> (carry, y) over a named axis of xs.

    Returns (final carry, ys) with the axis first in every NamedArray of ys. `remat=True` recomputes each
    step's activations in the backward pass instead of storing them (jax.checkpoint); a callable is used as
    the checkpoint policy (e.g. jax.checkpoint_policies.dots_saveable). `map_plain` lists positions in xs
    whose plain jax arrays are scanned over their leading dimension too (e.g. per-step PRNG keys).
    """
    return _scan(fn, axis, reverse, unroll, remat, map_plain, "scan")


def fold(
    fn: Callable,
    axis: AxisSelector,
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
    remat: bool | Callable = False,
    map_plain: Sequence[int] = (),
) -> Callable:
    """`fold(fn, axis)(init, *xs)`: loop fn(carry, *x_slices) -> carry over a named axis; return the carry."""

    def step(carry: Any, *x: Any) -> tuple[Any, None]:
        return fn(carry, *x), None

    scanned = _scan(step, axis, reverse, unroll, remat, map_plain, "fold")

    @functools.wraps(fn)
    def run(init: Any, *xs: Any) -> Any:
        return scanned(init, *xs)[0]

    return run
