"""Scan over layers: N like blocks as one module with a leading `layers` axis, and its unrolled twin."""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ._core import Axis, NamedArray, is_named
from ._policies import BLOCK_OUTPUT, CHECKPOINT_POLICIES, CheckpointPolicy


def _check_policy(policy: str) -> str:
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"Unknown gradient_checkpointing policy {policy!r}; choose one of {list(CHECKPOINT_POLICIES)}")
    return policy


def _check_unroll(unroll: int | bool) -> int | bool:
    if not isinstance(unroll, int) or (not isinstance(unroll, bool) and unroll < 1):  # bool is an int
        raise ValueError(
            f"unroll must be a positive number of layers per scan step, or True to unroll every layer; got {unroll!r}"
        )
    return unroll


def _check_layers(Layers: Axis) -> None:
    if not isinstance(Layers, Axis):
        raise TypeError(f"Layers must be an Axis (name and number of layers), got {Layers!r}")
    if Layers.size < 1:
        raise ValueError(f"Layers axis {Layers} needs at least one layer")


def _prepend_axis(tree: Any, Layers: Axis) -> Any:
    """Name the new leading dimension that vmap or scan gave every NamedArray leaf."""

    def fix(x: Any) -> Any:
        if is_named(x):
            return NamedArray(x.array, (Layers, *x.axes))
        return x

    return jax.tree.map(fix, tree, is_leaf=is_named)


def _strip_leading_axis(tree: Any) -> Any:
    """Drop the leading axis name of NamedArray leaves whose array lost that dimension (inside scan)."""

    def fix(x: Any) -> Any:
        if is_named(x):
            return NamedArray(x.array, x.axes[1:])
        return x

    return jax.tree.map(fix, tree, is_leaf=is_named)


def _layers_first(tree: Any, Layers: Axis, what: str) -> Any:
    """Move the Layers axis of every NamedArray leaf to the front, with a clear error when it is absent."""

    def fix(x: Any) -> Any:
        if is_named(x):
            if Layers.name not in x.axis_names:
                raise ValueError(
                    f"{what}: every NamedArray must have the {Layers.name!r} axis, one slice per layer; "
                    f"got one with axes {x.axis_names}"
                )
            x.axis_index(Layers)  # size check, with its own clear error
            return x.permute(Layers, ...)
        if eqx.is_array(x) and (x.ndim == 0 or x.shape[0] != Layers.size):
            raise ValueError(
                f"{what}: an unnamed array needs a leading dimension of {Layers.size} (one per layer), "
                f"got shape {x.shape}"
            )
        return x

    return jax.tree.map(fix, tree, is_leaf=is_named)


def _checked_per_layer(per_layer: dict[str, Any] | None, kwargs: dict, Layers: Axis) -> dict[str, Any]:
    per_layer = _layers_first(dict(per_layer or {}), Layers, "per_layer")
    assert per_layer is not None  # _layers_first maps a dict to a dict
    clash = set(per_layer) & (set(kwargs) | {"key"})
    if clash:
        raise ValueError(
            f"Arguments {sorted(clash)} are given both per layer and for all layers "
            "(the dropout key is always split per layer from key=)"
        )
    return per_layer


def _index_layer(tree: Any, i: int) -> Any:
    """Layer i of a tree whose NamedArray leaves lead with the Layers axis and whose arrays lead with N."""

    def take(x: Any) -> Any:
        if is_named(x):
            # A partitioned tree (eqx.partition, e.g. optimizer moments of trainable leaves only) holds None.
            return NamedArray(None if x.array is None else x.array[i], x.axes[1:])
        if eqx.is_array(x):
            return x[i]
        return x

    return jax.tree.map(take, tree, is_leaf=is_named)


def _layer_keys(key: jax.Array | None, n: int) -> jax.Array | None:
    return None if key is None else jax.random.split(key, n)


class _LayerInputs(eqx.Module):
    """What a scan slices per layer: the block's arrays, its dropout key and the per-layer inputs."""

    block: Any
    key: Any
    per_layer: Any


def _call_block(
    block: Any, carry: Any, key: Any, per_layer: dict, args: tuple, kwargs: dict, returns_outputs: bool
) -> tuple[Any, Any]:
    """Run one block on the carry and tag its output for the "save_block_outputs" policy."""
    result = block(carry, *args, key=key, **kwargs, **per_layer)
    if returns_outputs:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                "scan needs each block to return (carry, per_layer_output), "
                f"got {type(result).__name__}; use a plain call for blocks that return only the carry"
            )
        new_carry, out = result
    else:
        new_carry, out = result, None
    _check_carry(carry, new_carry)
    return checkpoint_name(new_carry, BLOCK_OUTPUT), out


def _remat(fn: Callable, policy: str) -> Callable:
    if policy == "none":
        return fn
    if policy == "save_block_outputs":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(BLOCK_OUTPUT))
    # "full" and both levels of "nested": keep nothing inside a block but its inputs.
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


def _nested_group_size(n: int) -> int:
    """ceil(sqrt(n)), so that there are at most that many groups too."""
    return math.isqrt(n - 1) + 1


def _check_carry(before: Any, after: Any) -> None:
    """A block must give back a carry of the same structure and axes as it received (scan checks dtypes)."""
    if jax.tree.structure(before) != jax.tree.structure(after):
        raise TypeError(
            "Each block must return a carry with the same structure and axes as its input x; "
            f"got {jax.tree.structure(after)} for input {jax.tree.structure(before)}"
        )


class _LayerStack(eqx.Module):
    """What Stacked and BlockSeq share: folding x through N blocks, with or without per-layer outputs."""

    @abc.abstractmethod
    def _run(
        self, x: Any, args: tuple, kwargs: dict, key: Any, per_layer: Any, returns_outputs: bool
    ) -> tuple[Any, Any]:
        """(final x, per-layer outputs stacked along Layers, or None unless returns_outputs)."""

    def __call__(
        self,
        x: Any,
        *args: Any,
        key: jax.Array | None = None,
        per_layer: dict[str, Any] | None = None,
        **kwargs,
    ) -> Any:
        """Fold x through the blocks: x = block_i(x, *args, key=key_i, **kwargs, **per_layer_i)."""
        carry, _ = self._run(x, args, kwargs, key, per_layer, returns_outputs=False)
        return carry

    def scan(
        self,
        x: Any,
        *args: Any,
        key: jax.Array | None = None,
        per_layer: dict[str, Any] | None = None,
        **kwargs,
    ) -> tuple[Any, Any]:
        """Like calling, but each block returns (x, out); gives (final x, outs stacked along Layers)."""
        return self._run(x, args, kwargs, key, per_layer, returns_outputs=True)


class Stacked(_LayerStack):
    """N homogeneous blocks held as one block whose parameters lead with the `Layers` axis, run by scan.

    `unroll` layers run per scan step (True: all of them). Unrolling changes only the compiled program, not the
    parameters: it trades compile time for speed where the scan's loop costs more than the layers (shallow
    models on CPU: the loop zero-fills and updates the stacked residuals and gradients in place).
    """

    stacked: Any
    Layers: Axis = eqx.field(static=True)
    gradient_checkpointing: CheckpointPolicy = eqx.field(static=True, default="none")
    unroll: int | bool = eqx.field(static=True, default=1)

    def __check_init__(self) -> None:
        _check_layers(self.Layers)
        _check_policy(self.gradient_checkpointing)
        _check_unroll(self.unroll)

    @classmethod
    def init(
        cls,
        Layers: Axis,
        make_block: Callable[[jax.Array], Any],
        *,
        key: jax.Array,
        gradient_checkpointing: CheckpointPolicy = "none",
        unroll: int | bool = 1,
    ) -> Stacked:
        """Build N blocks at once by vmapping `make_block` over per-layer keys split from `key`."""
        _check_layers(Layers)
        _check_policy(gradient_checkpointing)
        _check_unroll(unroll)
        keys = jax.random.split(key, Layers.size)
        blocks = eqx.filter_vmap(make_block)(keys)
        return cls(_prepend_axis(blocks, Layers), Layers, gradient_checkpointing, unroll)

    @classmethod
    def from_blocks(
        cls,
        Layers: Axis,
        blocks: Sequence[Any],
        *,
        gradient_checkpointing: CheckpointPolicy = "none",
        unroll: int | bool = 1,
    ) -> Stacked:
        """Stack per-layer blocks of identical structure into one Stacked module."""
        return cls(_stack_blocks(Layers, blocks), Layers, gradient_checkpointing, unroll)

    def with_gradient_checkpointing(self, policy: CheckpointPolicy) -> Stacked:
        """The same layers under another gradient checkpointing policy."""
        return dataclasses.replace(self, gradient_checkpointing=_check_policy(policy))

    def with_unroll(self, unroll: int | bool) -> Stacked:
        """The same layers, run `unroll` per scan step (True: every layer in one unrolled step)."""
        return dataclasses.replace(self, unroll=_check_unroll(unroll))

    def unstack(self) -> BlockSeq:
        """The same layers as an unrolled BlockSeq (one module per layer)."""
        return BlockSeq(self.blocks(), self.Layers, self.gradient_checkpointing)

    def blocks(self) -> tuple[Any, ...]:
        """The per-layer blocks, each with its own parameters (the layer axis dropped)."""
        return tuple(self.layer(i) for i in range(self.Layers.size))

    def layer(self, i: int) -> Any:
        """Block i, with its own parameters (the layer axis dropped)."""
        if not 0 <= i < self.Layers.size:
            raise IndexError(f"Layer {i} out of range for {self.Layers}")
        return _index_layer(self.stacked, i)

    def _run(
        self, x: Any, args: tuple, kwargs: dict, key: Any, per_layer: Any, returns_outputs: bool
    ) -> tuple[Any, Any]:
        Layers = self.Layers
        per_layer = _checked_per_layer(per_layer, kwargs, Layers)
        dynamic, static = eqx.partition(self.stacked, eqx.is_array)
        xs = _LayerInputs(dynamic, _layer_keys(key, Layers.size), per_layer)

        def one_layer(carry: Any, sliced: _LayerInputs) -> tuple[Any, Any]:
            # Scan sliced the arrays; the NamedArray leaves still name the Layers axis, so drop it.
            block = _strip_leading_axis(eqx.combine(sliced.block, static))
            per_layer_i = _strip_leading_axis(sliced.per_layer)
            return _call_block(block, carry, sliced.key, per_layer_i, args, kwargs, returns_outputs)

        policy = self.gradient_checkpointing
        if policy == "nested":
            carry, outs = _nested_scan(one_layer, x, xs, Layers.size, self.unroll)
        else:
            carry, outs = jax.lax.scan(_remat(one_layer, policy), x, xs, unroll=self.unroll)
        return carry, _prepend_axis(outs, Layers)


def _reshape_leading(tree: Any, shape: tuple[int, ...]) -> Any:
    return jax.tree.map(lambda a: a.reshape(shape + a.shape[1:]), tree)


def _nested_scan(one_layer: Callable, x: Any, xs: Any, n: int, unroll: int | bool) -> tuple[Any, Any]:
    """Scan over ~sqrt(n) groups of ~sqrt(n) layers, rematerialising at both levels; a short tail group
    takes the layers left over when n is not a multiple of the group size. `unroll` applies to the layers
    within a group, which is where the loop runs most often."""
    group = _nested_group_size(n)
    n_groups, tail = divmod(n, group)
    inner = _remat(one_layer, "full")

    def one_group(carry: Any, group_xs: Any) -> tuple[Any, Any]:
        return jax.lax.scan(inner, carry, group_xs, unroll=unroll)

    head_xs = jax.tree.map(lambda a: a[: n_groups * group], xs)
    carry, outs = jax.lax.scan(_remat(one_group, "full"), x, _reshape_leading(head_xs, (n_groups, group)))
    outs = _reshape_leading_merge(outs, n_groups * group)
    if tail:
        tail_xs = jax.tree.map(lambda a: a[n_groups * group :], xs)
        carry, tail_outs = _remat(one_group, "full")(carry, tail_xs)
        outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, tail_outs)
    return carry, outs


def _reshape_leading_merge(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda a: a.reshape((n, *a.shape[2:])), tree)


def _stack_blocks(Layers: Axis, blocks: Sequence[Any]) -> Any:
    _check_layers(Layers)
    blocks = list(blocks)
    if len(blocks) != Layers.size:
        raise ValueError(f"Got {len(blocks)} blocks for {Layers}: give exactly one block per layer")
    first_def = jax.tree.structure(blocks[0], is_leaf=is_named)
    first_leaves = jax.tree.leaves(blocks[0], is_leaf=is_named)
    for i, block in enumerate(blocks[1:], start=1):
        leaves = jax.tree.leaves(block, is_leaf=is_named)
        if jax.tree.structure(block, is_leaf=is_named) != first_def:
            raise ValueError(f"Block {i} differs in structure from block 0; stacked blocks must be alike")
        for a, b in zip(first_leaves, leaves, strict=True):
            _check_same_kind(a, b, i)

    def stack(*leaves: Any) -> Any:
        first = leaves[0]
        if is_named(first):
            return NamedArray(jnp.stack([leaf.array for leaf in leaves]), (Layers, *first.axes))
        if eqx.is_array(first):
            return jnp.stack(leaves)
        return first

    return jax.tree.map(stack, *blocks, is_leaf=is_named)


def _check_same_kind(a: Any, b: Any, i: int) -> None:
    if is_named(a) or is_named(b):
        if not (is_named(a) and is_named(b)) or a.axes != b.axes or a.dtype != b.dtype:
            raise ValueError(f"Block {i} has a parameter {b!r} where block 0 has {a!r}: axes and dtypes must match")
    elif eqx.is_array(a) or eqx.is_array(b):
        if not (eqx.is_array(a) and eqx.is_array(b)) or a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(
                f"Block {i} has an array of shape {getattr(b, 'shape', None)} where block 0 has "
                f"{getattr(a, 'shape', None)}: shapes and dtypes must match"
            )
    elif a is not b and a != b:
        raise ValueError(f"Block {i} has the non-array field value {b!r} where block 0 has {a!r}")


class BlockSeq(_LayerStack):
    """The same N blocks unrolled: a tuple of per-layer modules applied in a Python loop."""

    blocks: tuple[Any, ...]
    Layers: Axis = eqx.field(static=True)
    gradient_checkpointing: CheckpointPolicy = eqx.field(static=True, default="none")

    def __check_init__(self) -> None:
        _check_layers(self.Layers)
        _check_policy(self.gradient_checkpointing)
        if len(self.blocks) != self.Layers.size:
            raise ValueError(f"Got {len(self.blocks)} blocks for {self.Layers}: give one block per layer")

    @classmethod
    def init(
        cls,
        Layers: Axis,
        make_block: Callable[[jax.Array], Any],
        *,
        key: jax.Array,
        gradient_checkpointing: CheckpointPolicy = "none",
    ) -> BlockSeq:
        """Build N blocks one by one from per-layer keys split from `key` (the same keys as Stacked.init)."""
        _check_layers(Layers)
        keys = jax.random.split(key, Layers.size)
        return cls(tuple(make_block(k) for k in keys), Layers, gradient_checkpointing)

    def with_gradient_checkpointing(self, policy: CheckpointPolicy) -> BlockSeq:
        """The same layers under another gradient checkpointing policy."""
        return dataclasses.replace(self, gradient_checkpointing=_check_policy(policy))

    def stack(self) -> Stacked:
        """The same layers as a Stacked module."""
        policy = self.gradient_checkpointing
        return Stacked.from_blocks(self.Layers, self.blocks, gradient_checkpointing=policy)

    def _run(
        self, x: Any, args: tuple, kwargs: dict, key: Any, per_layer: Any, returns_outputs: bool
    ) -> tuple[Any, Any]:
        Layers = self.Layers
        per_layer = _checked_per_layer(per_layer, kwargs, Layers)
        keys = _layer_keys(key, Layers.size)
        # Per-block remat mirrors what Stacked does inside each scan step ("nested" has no groups here).
        policy = "full" if self.gradient_checkpointing == "nested" else self.gradient_checkpointing
        outs = []
        for i, block in enumerate(self.blocks):
            dynamic, static = eqx.partition(block, eqx.is_array)
            per_layer_i = _index_layer(per_layer, i)
            key_i = None if keys is None else keys[i]

            def one_layer(carry: Any, dynamic: Any, key_i: Any, per_layer_i: Any, static: Any = static):
                block = eqx.combine(dynamic, static)
                return _call_block(block, carry, key_i, per_layer_i, args, kwargs, returns_outputs)

            x, out = _remat(one_layer, policy)(x, dynamic, key_i, per_layer_i)
            outs.append(out)
        if not returns_outputs:
            return x, None
        stacked_outs = jax.tree.map(lambda *leaves: jnp.stack(leaves), *outs)
        return x, _prepend_axis(stacked_outs, Layers)


__all__ = ["BLOCK_OUTPUT", "CHECKPOINT_POLICIES", "BlockSeq", "CheckpointPolicy", "Stacked"]
