"""Boolean attention masks as NamedArrays (True = may attend), built by name and combined with and/or.

A mask only has the axes it depends on, e.g. (position, key_position) for causal or (batch, key_position)
for padding; attention broadcasts it by name against its scores.
"""

from __future__ import annotations

from functools import reduce
from typing import overload

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core import Axis, AxisSelector, NamedArray, axis_name, permute


def _positions(axis: Axis) -> NamedArray:
    if not isinstance(axis, Axis):
        raise TypeError(f"Masks need Axis objects with sizes, got {axis!r}")
    return NamedArray(jnp.arange(axis.size, dtype=jnp.int32), (axis,))


def _check_distinct(QPos: Axis, KPos: Axis) -> None:
    if axis_name(QPos) == axis_name(KPos):
        raise ValueError(
            f"Query and key position axes must have different names, both are {axis_name(QPos)!r}; "
            "rename the keys' axis (e.g. x.rename({'position': 'key_position'}))"
        )


def _as_int32(value: NamedArray | int | jax.Array, refusal: str) -> NamedArray | jax.Array:
    """An int32 copy of a named or plain value; a NamedArray whose dtype is not an integer is refused."""
    if isinstance(value, NamedArray):
        if not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(f"{refusal}, got dtype {value.dtype}")
        return value.astype(jnp.int32)
    return jnp.asarray(value, jnp.int32)


def causal_mask(QPos: Axis, KPos: Axis, *, offset: int | jax.Array | NamedArray = 0) -> NamedArray:
    """(QPos, KPos) mask: query i sees key k iff k <= i + offset (offset: position of query 0 in the keys).

    For decoding with a KV cache that already holds t tokens, the new queries start at offset t; a
    NamedArray offset (e.g. over batch) gives each row its own and adds its axes to the mask.
    """
    _check_distinct(QPos, KPos)
    offset = _as_int32(offset, "causal_mask needs an integer offset")
    q = _positions(QPos) + offset
    return q >= _positions(KPos)


def sliding_window_mask(
    QPos: Axis, KPos: Axis, window: int | jax.Array | None, *, offset: int | jax.Array = 0
) -> NamedArray | None:
    """(QPos, KPos) mask: query i sees key k iff k > i + offset - window, the last `window` keys up to i.

    Combine it with causal_mask for sliding-window attention (Mistral, Gemma 2's local layers); the query's own
    key counts, as in Hugging Face. `window` may be traced (a per-layer value in a scan); a window <= 0, or
    None, means no limit (None gives None, i.e. no mask at all).
    """
    if window is None:
        return None
    _check_distinct(QPos, KPos)
    window = jnp.asarray(window, jnp.int32)
    q = _positions(QPos) + jnp.asarray(offset, jnp.int32)
    return (q - window < _positions(KPos)) | (window <= 0)


def chunked_mask(
    query_positions: NamedArray, key_positions: NamedArray, chunk_size: int | jax.Array | None
) -> NamedArray | None:
    """Keys in the same chunk of `chunk_size` positions as their query: position // chunk_size equal (Llama 4's
    chunked local attention; combine it with the causal mask). The two arrays carry the query and the key
    position axis, as for segment_mask. None gives None (no chunking)."""
    if chunk_size is None:
        return None
    for positions in (query_positions, key_positions):
        if not isinstance(positions, NamedArray) or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"chunked_mask needs integer NamedArrays of positions, got {positions!r}")
    if isinstance(chunk_size, int) and chunk_size < 1:
        raise ValueError(f"chunked_mask needs a positive chunk_size, got {chunk_size!r}")
    chunk = jnp.asarray(chunk_size, jnp.int32)
    return query_positions.astype(jnp.int32) // chunk == key_positions.astype(jnp.int32) // chunk


def length_mask(lengths: NamedArray | int | jax.Array, Pos: Axis) -> NamedArray:
    """Padding mask over Pos: True for the first `lengths` positions (lengths may be per batch row)."""
    lengths = _as_int32(lengths, "length_mask needs integer lengths")
    if not isinstance(lengths, NamedArray):
        if lengths.ndim != 0:
            raise ValueError(
                f"length_mask got unnamed lengths of shape {lengths.shape}; pass a NamedArray, e.g. "
                "nt.named(lengths, ('batch',)), so that they broadcast by name"
            )
        lengths = NamedArray(lengths, ())
    if lengths.ndim != 0 and lengths.has_axis(Pos.name):
        raise ValueError(f"length_mask lengths must not have the position axis {Pos.name!r}")
    return lengths > _positions(Pos)


def segment_mask(query_segment_ids: NamedArray, key_segment_ids: NamedArray) -> NamedArray:
    """Tokens attend only within their own segment (packed sequences): query id == key id.

    The two arrays carry the query and the key position axis respectively (for self-attention, the key
    ids are the query ids renamed: `ids.rename({"position": "key_position"})`); other axes such as batch
    are shared by name.
    """
    for ids in (query_segment_ids, key_segment_ids):
        if not isinstance(ids, NamedArray) or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"segment_mask needs integer NamedArrays of segment ids, got {ids!r}")
    return query_segment_ids == key_segment_ids


def packed_causal_mask(
    segment_ids: NamedArray, Pos: AxisSelector = "position", KPos: AxisSelector = "key_position"
) -> NamedArray:
    """Self-attention mask of packed sequences: slot i sees slot k iff k <= i and both hold the same segment.

    `segment_ids` (integer, e.g. (batch, position)) numbers the documents packed along Pos; the mask has its
    axes with Pos doubled into (Pos, KPos). Padding given its own id only sees itself and other padding.
    """
    if not isinstance(segment_ids, NamedArray) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"packed_causal_mask needs an integer NamedArray of segment ids, got {segment_ids!r}")
    QPos = segment_ids.resolve_axis(axis_name(Pos))
    KeyPos = QPos.alias(axis_name(KPos))
    same = AttentionMask.packed(segment_ids).materialize(QPos.name, KeyPos.name)  # (others, Pos, KPos)
    assert same is not None  # a mask of segment ids materializes to an array
    return permute(same & causal_mask(QPos, KeyPos), same.axis_names)


def prefix_lm_mask(
    QPos: Axis, KPos: Axis, prefix_length: NamedArray | int | jax.Array, *, offset: int | jax.Array = 0
) -> NamedArray:
    """Prefix-LM: every query sees all keys of the prefix (k < prefix_length), and earlier keys causally."""
    return causal_mask(QPos, KPos, offset=offset) | length_mask(prefix_length, KPos)


def forgetful_causal_mask(KPos: Axis, prob: float, *, key: jax.Array, batch_axes: tuple[Axis, ...] = ()) -> NamedArray:
    """Forgetful causal masking (Liu et al. 2022, FCM): a (*batch_axes, KPos) mask in which every key but the
    first is masked out with probability `prob`, drawn independently for each example from `key`.

    It is meant to be and-ed with a causal mask during training only; the first key stays visible so that no
    query is left with nothing to attend to.
    """
    if not 0.0 <= prob < 1.0:
        raise ValueError(f"forgetful_causal_mask needs 0 <= prob < 1, got {prob}")
    axes = (*batch_axes, KPos)
    keep = jax.random.bernoulli(key, 1.0 - prob, tuple(a.size for a in axes))
    return NamedArray(keep.at[..., 0].set(True), axes)


class AttentionMask(eqx.Module):
    """An attention mask kept in parts: packed rows' segment ids, and a boolean mask by name (True = may attend).

    Kernels that take segment ids (blockwise attention, the splash kernel) use them as they are and never build
    the (position, key_position) mask; the others build it with `materialize`. The causal rule is not part of
    it: causal attention applies that by index. Combine with `&` or `and_masks`.
    """

    # Integer ids (..., position): a query sees only the keys of its own segment (the keys' ids are the same,
    # along key_position: self-attention).
    segment_ids: NamedArray | None = None
    explicit: NamedArray | None = None

    @staticmethod
    def packed(segment_ids: NamedArray) -> AttentionMask:
        """The mask of rows that pack several documents, numbered by `segment_ids` (padding: an id of its own)."""
        if not isinstance(segment_ids, NamedArray) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"AttentionMask.packed needs an integer NamedArray of segment ids, got {segment_ids!r}")
        return AttentionMask(segment_ids=segment_ids)

    def key_segment_ids(self, Pos: AxisSelector = "position", KPos: AxisSelector = "key_position") -> NamedArray:
        """The segment ids along the key axis."""
        if self.segment_ids is None:
            raise ValueError("This AttentionMask has no segment ids: build it with AttentionMask.packed(ids)")
        return self.segment_ids.rename({axis_name(Pos): axis_name(KPos)})

    def materialize(self, Pos: AxisSelector = "position", KPos: AxisSelector = "key_position") -> NamedArray | None:
        """The whole boolean mask: same segment (with the ids' other axes, then Pos, KPos) and the explicit mask."""
        same = None
        if self.segment_ids is not None:
            keys = self.key_segment_ids(Pos, KPos)
            others = [a.name for a in self.segment_ids.axes if a.name != axis_name(Pos)]
            same = permute(segment_mask(self.segment_ids, keys), (*others, axis_name(Pos), axis_name(KPos)))
        return and_masks(same, self.explicit)

    def __and__(self, other: AttentionMask | NamedArray | None) -> AttentionMask:
        if other is None:
            return self
        if isinstance(other, NamedArray):
            return AttentionMask(self.segment_ids, and_masks(self.explicit, other))
        if self.segment_ids is not None and other.segment_ids is not None:
            # Two numberings: keep one as ids and the other as the mask it means.
            return AttentionMask(self.segment_ids, and_masks(self.explicit, other.materialize()))
        return AttentionMask(
            self.segment_ids if self.segment_ids is not None else other.segment_ids,
            and_masks(self.explicit, other.explicit),
        )

    __rand__ = __and__


def split_mask(mask: AttentionMask | NamedArray | None) -> tuple[NamedArray | None, NamedArray | None]:
    """(segment ids, boolean mask) of any mask argument: an AttentionMask's parts, or (None, mask)."""
    if isinstance(mask, AttentionMask):
        return mask.segment_ids, mask.explicit
    return None, mask


@overload
def and_masks(*masks: NamedArray | None) -> NamedArray | None: ...
@overload
def and_masks(*masks: AttentionMask | NamedArray | None) -> AttentionMask | NamedArray | None: ...
def and_masks(*masks: AttentionMask | NamedArray | None) -> AttentionMask | NamedArray | None:
    """Allowed where every mask allows; None means "no restriction" and is skipped. With an AttentionMask among
    them the result is one."""
    present = [m for m in masks if m is not None]
    # An AttentionMask first, so that `&` keeps its parts apart.
    present.sort(key=lambda m: not isinstance(m, AttentionMask))
    return reduce(lambda a, b: a & b, present) if present else None


def or_masks(*masks: NamedArray | None) -> NamedArray | None:
    """Allowed where any mask allows; None means "no restriction", so any None gives None."""
    present = [m for m in masks if m is not None]
    if not masks or len(present) < len(masks):
        return None
    return reduce(lambda a, b: a | b, present)
