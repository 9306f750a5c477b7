"""Backpack (Hewitt et al., 2023): next-token logits from a context-weighted sum of per-token sense vectors.

Each token x_j gets `num_senses` sense vectors C(x_j)_l from its word embedding alone (the sense network),
and a GPT-2 transformer over the sequence gives, per sense l, causal attention weights alpha_l(i, j). The
output at position i is  o_i = (1 / num_senses) * sum_l sum_{j <= i} alpha_l(i, j) C(x_j)_l,  and the
logits are o_i against the (tied) word embeddings. The weights are computed as attention with one head per
sense; the value of "head" l at position j is the sense vector C(x_j)_l.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import MLP, LayerNorm, Linear

from .backpack_config import SENSES, BackpackConfig
from .gpt2 import Gpt2LMHeadModel
from .kv_cache import KEY_POSITION, KVCache
from .model import POSITION, TiedHeadModel, check_input_ids, dropout, split_key


class SenseNetwork(eqx.Module):
    """Word embedding -> num_senses sense vectors: x' = ln(e + block(e)), senses = final(x').

    Layouts: block.up.weight (mlp, embed), block.down.weight (embed, mlp), ln.weight/bias (embed),
    final.up.weight (mlp, embed), final.down.weight (senses, embed, mlp).
    """

    block: MLP
    ln: LayerNorm
    final: MLP

    @staticmethod
    def init(config: BackpackConfig, *, key: jax.Array) -> SenseNetwork:
        """Fresh weights ~ Normal(0, initializer_range)."""
        c = config
        k1, k2, k3, k4 = jax.random.split(key, 4)
        std = c.initializer_range

        def linear(In, Out, k) -> Linear:
            return Linear.init(In, Out, key=k, use_bias=c.use_bias, init_scale=std, scale_by_fan_in=False)

        block = MLP(linear(c.Embed, c.SenseMlp, k1), linear(c.SenseMlp, c.Embed, k2), c.activation_function)
        final = MLP(linear(c.Embed, c.SenseMlp, k3), linear(c.SenseMlp, (c.Senses, c.Embed), k4), c.activation_function)
        ln = LayerNorm.init(c.Embed, eps=c.layer_norm_epsilon, use_bias=c.use_bias)
        return SenseNetwork(block, ln, final)

    def __call__(self, embedded: NamedArray) -> NamedArray:
        """Sense vectors (..., senses, embed) for word embeddings (..., embed)."""
        return self.final(self.ln(embedded + self.block(embedded)))


class BackpackCache(eqx.Module):
    """What decoding keeps per past position: the transformer's keys/values, sense keys and sense vectors."""

    transformer: KVCache
    sense_keys: NamedArray  # (..., key_position, senses, head_size)
    senses: NamedArray  # (..., key_position, senses, embed)


class BackpackLMHeadModel(TiedHeadModel):
    """Backpack language model over a GPT-2 transformer; the head is the transformer's token embeddings.

    Parameter tree (axes of each weight):
      transformer: a Gpt2LMHeadModel (see its docstring); its token_embeddings are also the output head
      sense_net: SenseNetwork (see its docstring)
      sense_query.weight, sense_key.weight (senses, head_size, embed), biases (senses, head_size) if use_bias
    """

    tied_embeddings = "transformer.token_embeddings"

    transformer: Gpt2LMHeadModel
    sense_net: SenseNetwork
    sense_query: Linear
    sense_key: Linear
    config: BackpackConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)
    inference: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(Vocab: Axis, config: BackpackConfig, *, key: jax.Array) -> BackpackLMHeadModel:
        """Fresh weights, GPT-2-style initialisation everywhere."""
        c = config
        k_tr, k_sense, k_q, k_k = jax.random.split(key, 4)
        transformer = Gpt2LMHeadModel.init(Vocab, c, key=k_tr)
        Out = (c.Senses, c.SenseHeadSize)

        def proj(k) -> Linear:
            std = c.initializer_range
            return Linear.init(c.Embed, Out, key=k, use_bias=c.use_bias, init_scale=std, scale_by_fan_in=False)

        return BackpackLMHeadModel(transformer, SenseNetwork.init(c, key=k_sense), proj(k_q), proj(k_k), c, Vocab)

    @property
    def blocks(self) -> nt.Stacked | nt.BlockSeq:
        """The transformer's layer stack."""
        return self.transformer.blocks

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        cache: BackpackCache | None = None,
        cache_offset: jax.Array | int = 0,
    ) -> tuple[NamedArray, BackpackCache | None]:
        """The sense-weighted outputs o (..., position, embed) and, with a cache, the updated cache."""
        input_ids = check_input_ids(input_ids, self.config.seq_len)
        k_tr, k_drop = split_key(key, 2)
        transformer = self.transformer
        if transformer.inference != self.inference:
            transformer = dataclasses.replace(transformer, inference=self.inference)
        hidden, kv = transformer.activations(
            input_ids,
            attn_mask,
            key=k_tr,
            cache=None if cache is None else cache.transformer,
            cache_offset=cache_offset,
        )
        senses = self.sense_net(transformer.token_embeddings.embed(input_ids))
        senses = dropout(senses, self.config.embed_pdrop, k_drop, self.inference)
        query = self.sense_query(hidden)
        sense_keys = self.sense_key(hidden).rename({POSITION: KEY_POSITION})
        senses = senses.rename({POSITION: KEY_POSITION})
        positions = nt.arange(input_ids.resolve_axis(POSITION), dtype=jnp.int32) + jnp.asarray(cache_offset, jnp.int32)
        new_cache = None
        if cache is not None:
            assert kv is not None  # the transformer was given cache.transformer, so it returns its update
            sense_keys = nt.dynamic_update_slice(cache.sense_keys, sense_keys, {KEY_POSITION: cache_offset})
            senses = nt.dynamic_update_slice(cache.senses, senses, {KEY_POSITION: cache_offset})
            new_cache = BackpackCache(kv, sense_keys, senses)
            sense_keys, senses = sense_keys.astype(query.dtype), senses.astype(query.dtype)
        # Without a cache, causality by index, which lets the attention skip the keys a block of queries cannot see.
        mask = attn_mask.materialize() if isinstance(attn_mask, nt.nn.AttentionMask) else attn_mask
        if cache is not None:
            visible = positions >= nt.arange(sense_keys.resolve_axis(KEY_POSITION), dtype=jnp.int32)
            mask = visible if mask is None else visible & mask
        mixed = nt.nn.dot_product_attention(
            POSITION, KEY_POSITION, self.config.SenseHeadSize, query, sense_keys, senses, mask, causal=cache is None
        )
        out = nt.sum(mixed, SENSES) / jnp.asarray(self.config.num_senses, mixed.dtype)
        # named-tensors' permute takes `...` (its docstring says so); its annotation does not yet.
        out = nt.permute(out, (..., POSITION, self.config.Embed.name))
        return out, new_cache

    def init_cache(self, batch_axes: tuple[Axis, ...], max_length: int, dtype=jnp.float32) -> BackpackCache:
        """Zeroed transformer keys/values, sense keys and sense vectors with room for max_length positions."""
        c = self.config
        KeyPos = Axis(KEY_POSITION, max_length)
        return BackpackCache(
            self.transformer.init_cache(batch_axes, max_length, dtype),
            nt.zeros((*batch_axes, KeyPos, c.Senses, c.SenseHeadSize), dtype),
            nt.zeros((*batch_axes, KeyPos, c.Senses, c.Embed), dtype),
        )
