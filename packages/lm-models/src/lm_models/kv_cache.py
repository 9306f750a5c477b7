"""KVCache: the keys and values of the positions decoded so far, one slot per position up to a fixed length."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray

KEY_POSITION = "key_position"


class KVCache(eqx.Module):
    """Keys and values with axes (..., key_position, kv_heads, head_size); stacked caches lead with `layers`."""

    key: NamedArray
    value: NamedArray

    @staticmethod
    def zeros(
        batch_axes: tuple[Axis, ...], KeyPos: Axis, KVHeads: Axis, HeadSize: Axis, *, dtype=jnp.float32
    ) -> KVCache:
        """An empty cache for one layer with room for KeyPos.size positions."""
        axes = (*batch_axes, KeyPos, KVHeads, HeadSize)
        return KVCache(nt.zeros(axes, dtype), nt.zeros(axes, dtype))

    def write(self, key: NamedArray, value: NamedArray, offset) -> KVCache:
        """The cache with new keys/values (axis key_position) stored from slot `offset` on."""
        return KVCache(
            nt.dynamic_update_slice(self.key, key, {KEY_POSITION: offset}),
            nt.dynamic_update_slice(self.value, value, {KEY_POSITION: offset}),
        )

    def read(self) -> tuple[NamedArray, NamedArray, NamedArray]:
        """The keys and values of every slot, and the position of each slot (slot j is position j)."""
        return self.key, self.value, nt.arange(self.key.resolve_axis(KEY_POSITION), dtype=jnp.int32)
