"""Llama 1/2/3: RMSNorm, SwiGLU MLP, rotary positions (with linear or llama3 scaling), grouped-query attention."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import Embedding, GatedMLP, Linear, RMSNorm

from .attention import Attention
from .kv_cache import KVCache
from .llama_config import LlamaConfig
from .model import LmHeadModel, check_input_ids, given_positions, layer_stack_cache, run_layer_stack, split_key
from .stacking import build_blocks


class LlamaBlock(eqx.Module):
    """x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x))."""

    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: GatedMLP

    @staticmethod
    def init(config: LlamaConfig, *, key: jax.Array) -> LlamaBlock:
        """One block with fresh weights."""
        c = config
        k_attn, k_gate, k_up, k_down = jax.random.split(key, 4)
        std = c.initializer_range

        def linear(In, Out, k) -> Linear:
            return Linear.init(In, Out, key=k, use_bias=c.use_bias, init_scale=std, scale_by_fan_in=False)

        def norm() -> RMSNorm:
            return RMSNorm.init(c.Embed, eps=c.layer_norm_epsilon, use_weight=c.use_layer_norm_weight)

        mlp = GatedMLP(
            linear(c.Embed, c.Mlp, k_gate),
            linear(c.Embed, c.Mlp, k_up),
            linear(c.Mlp, c.Embed, k_down),
            c.activation_function,
        )
        attn = Attention.init(c.attention_options(), key=k_attn, init_std=std, output_init_std=std)
        return LlamaBlock(norm(), attn, norm(), mlp)

    def __call__(
        self,
        x: NamedArray,
        mask: NamedArray | None,
        positions: NamedArray,
        *,
        key: jax.Array | None,
        inference: bool,
        cache_offset: jax.Array | int,
        cache: KVCache | None = None,
    ) -> tuple[NamedArray, KVCache | None]:
        """Apply the block; returns the new x and this layer's updated cache (None without a cache)."""
        attn_out, cache = self.self_attn(
            self.input_layernorm(x),
            mask,
            positions,
            cache=cache,
            cache_offset=cache_offset,
            key=key,
            inference=inference,
        )
        x = x + attn_out
        return nt.shard(x + self.mlp(self.post_attention_layernorm(x))), cache


class LlamaLMHeadModel(LmHeadModel):
    """Llama language model with an untied `lm_head` (or the token embeddings when tie_word_embeddings).

    Parameter tree (axes of each weight):
      embed_tokens.weight (vocab, embed)
      blocks: nt.Stacked (leading `layers` axis on every weight below) or nt.BlockSeq (one per layer)
        input_layernorm.weight, post_attention_layernorm.weight (embed)
        self_attn.q_proj.weight (heads, head_size, embed); k_proj/v_proj.weight (kv_heads, head_size, embed)
        self_attn.o_proj.weight (embed, heads, head_size)   (biases over the output axes if use_bias)
        mlp.gate.weight, mlp.up.weight (mlp, embed); mlp.down.weight (embed, mlp)
      norm.weight (embed)
      lm_head.weight (vocab, embed), or lm_head None when tied
    """

    embed_tokens: Embedding
    blocks: nt.Stacked | nt.BlockSeq
    norm: RMSNorm
    lm_head: Linear | None
    config: LlamaConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)
    inference: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(Vocab: Axis, config: LlamaConfig, *, key: jax.Array) -> LlamaLMHeadModel:
        """Fresh weights: every weight ~ Normal(0, initializer_range) and norms at one."""
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        c = config
        embed = Embedding.init(Vocab, c.Embed, key=k_embed, init_scale=c.initializer_range)
        blocks = build_blocks(c, lambda k: LlamaBlock.init(c, key=k), key=k_blocks)
        norm = RMSNorm.init(c.Embed, eps=c.layer_norm_epsilon, use_weight=c.use_layer_norm_weight)
        lm_head = None
        if not c.tie_word_embeddings:
            lm_head = Linear.init(
                c.Embed, Vocab, key=k_head, use_bias=False, init_scale=c.initializer_range, scale_by_fan_in=False
            )
        return LlamaLMHeadModel(embed, blocks, norm, lm_head, c, Vocab)

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_offset: jax.Array | int = 0,
        positions: NamedArray | None = None,
    ) -> tuple[NamedArray, KVCache | None]:
        """Final hidden states (after the last norm) and, when a cache is given, the updated cache."""
        input_ids = check_input_ids(input_ids, None)
        positions = given_positions(input_ids, positions, cache_offset)
        (k_blocks,) = split_key(key, 1)
        x = self.embed_tokens.embed(input_ids)
        x, new_cache = run_layer_stack(
            self.blocks,
            x,
            attn_mask,
            positions,
            key=k_blocks,
            cache=cache,
            cache_offset=cache_offset,
            inference=self.inference,
        )
        return self.norm(x), new_cache

    def unembedding(self) -> NamedArray:
        """The output head (vocab, embed): lm_head's weight, or the token embeddings when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_cache(self, batch_axes: tuple[Axis, ...], max_length: int, dtype=jnp.float32) -> KVCache:
        """Zeroed keys/values for every layer: axes (layers, *batch_axes, key_position, kv_heads, head_size)."""
        return layer_stack_cache(self.config, batch_axes, max_length, dtype)
