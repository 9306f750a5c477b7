"""Embedding: token ids to vectors, and the tied unembedding back to vocabulary logits."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._core import Axis, NamedArray, dot, permute
from ._checks import axes_tuple, require_axes, require_same_dtype


class Embedding(eqx.Module):
    """A (Vocab, Embed) table: `embed` looks rows up by id, `unembed` scores vectors against every row.

    Layout: `weight` has axes (Vocab, Embed) in that order.
    """

    weight: NamedArray
    Vocab: Axis = eqx.field(static=True)
    Embed: Axis = eqx.field(static=True)

    @staticmethod
    def init(
        Vocab: Axis,
        Embed: Axis,
        *,
        key: jax.Array,
        init_scale: float = 0.02,
        dtype: DTypeLike = jnp.float32,
    ) -> Embedding:
        """Rows ~ Normal(0, init_scale)."""
        (Vocab,) = axes_tuple(Vocab, "Embedding.init Vocab")
        (Embed,) = axes_tuple(Embed, "Embedding.init Embed")
        if Vocab.name == Embed.name:
            raise ValueError(f"Embedding needs distinct Vocab and Embed names, got {Vocab.name!r} twice")
        table = jax.random.normal(key, (Vocab.size, Embed.size), jnp.float32) * init_scale
        return Embedding(NamedArray(table.astype(dtype), (Vocab, Embed)), Vocab, Embed)

    def embed(self, input_ids: NamedArray) -> NamedArray:
        """The row of each id: the ids' axes followed by Embed."""
        if not isinstance(input_ids, NamedArray):
            raise TypeError(f"Embedding.embed takes a NamedArray of ids, got {type(input_ids).__name__}")
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise TypeError(f"Embedding.embed needs integer ids, got dtype {input_ids.dtype}")
        if input_ids.has_axis(self.Embed.name):
            raise ValueError(f"Embedding ids already have an axis named {self.Embed.name!r}")
        ids = input_ids.array
        # Only a concrete array is checked eagerly. One closed over by a jitted function is concrete, but
        # jnp.min on it is traced there: evaluate it now (ensure_compile_time_eval) instead of failing.
        if not isinstance(ids, jax.core.Tracer):  # pyright: ignore[reportAttributeAccessIssue] (jax.core is imported by jax)
            with jax.ensure_compile_time_eval():
                lo, hi = int(jnp.min(ids, initial=0)), int(jnp.max(ids, initial=0))
            if lo < 0 or hi >= self.Vocab.size:
                raise ValueError(
                    f"Embedding.embed got ids in [{lo}, {hi}], outside [0, {self.Vocab.size}) of axis "
                    f"{self.Vocab.name!r}; check the tokenizer's vocabulary size against the model's"
                )
        table = permute(self.weight, (self.Vocab, self.Embed)).array
        # Under jit nothing can raise: a bad id (negative ones too, which numpy would wrap) reads as NaN,
        # which shows up in the loss instead of silently reusing another token's row.
        ids = jnp.where(ids < 0, self.Vocab.size, ids)
        rows = jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)
        return NamedArray(rows, (*input_ids.axes, self.Embed))

    def unembed(self, x: NamedArray) -> NamedArray:
        """Logits over Vocab: x's Embed axis contracted with every row; x's other axes are kept."""
        require_axes(x, self.Embed, "Embedding.unembed")
        if x.has_axis(self.Vocab.name):
            raise ValueError(f"Embedding.unembed input already has a {self.Vocab.name!r} axis")
        require_same_dtype(x, self.weight, "Embedding.unembed")
        return dot(x, self.weight, axis=self.Embed)

    def __call__(self, input_ids: NamedArray) -> NamedArray:
        """Same as `embed`."""
        return self.embed(input_ids)
