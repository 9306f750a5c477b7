"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, tied input and output embeddings."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import MLP, Embedding, LayerNorm

from .attention import Attention
from .gpt2_config import Gpt2StyleConfig
from .kv_cache import KVCache
from .model import (
    TiedHeadModel,
    check_input_ids,
    dropout,
    given_positions,
    run_layer_stack,
    split_key,
)
from .residual import add_attention_and_mlp, two_matrix_mlp
from .stacking import build_blocks


class Gpt2Block(eqx.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)); dropout on each residual branch."""

    ln_1: LayerNorm
    attn: Attention
    ln_2: LayerNorm
    mlp: MLP
    resid_pdrop: float = eqx.field(static=True)
    scale_by_layer: bool = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2StyleConfig, *, key: jax.Array) -> Gpt2Block:
        """One block with fresh weights."""
        k_attn, k_up, k_down = jax.random.split(key, 3)
        std = config.initializer_range
        out_std = std / math.sqrt(2 * config.num_layers)
        c = config

        def norm() -> LayerNorm:
            return LayerNorm.init(c.Embed, eps=c.layer_norm_epsilon, use_bias=c.use_bias)

        mlp = two_matrix_mlp(
            c.Embed,
            c.Mlp,
            c.activation_function,
            keys=(k_up, k_down),
            use_bias=c.use_bias,
            init_std=std,
            output_init_std=out_std,
        )
        attn = Attention.init(c.attention_options(), key=k_attn, init_std=std, output_init_std=out_std)
        return Gpt2Block(norm(), attn, norm(), mlp, c.resid_pdrop, c.scale_attn_by_inverse_layer_idx)

    def __call__(
        self,
        x: NamedArray,
        mask: NamedArray | None,
        positions: NamedArray,
        *,
        key: jax.Array | None,
        inference: bool,
        cache_offset: jax.Array | int,
        layer_index: NamedArray,
        cache: KVCache | None = None,
    ) -> tuple[NamedArray, KVCache | None]:
        """Apply the block; returns the new x and this layer's updated cache (None without a cache)."""
        k_attn, k_drop_attn, k_drop_mlp = split_key(key, 3)
        # GPT-2's scale_attn_by_inverse_layer_idx divides layer i's attention scores by i + 1.
        scale = (1.0 / (layer_index + 1.0)).astype(x.dtype) if self.scale_by_layer else None
        attn_out, cache = self.attn(
            self.ln_1(x),
            mask,
            positions,
            cache=cache,
            cache_offset=cache_offset,
            query_scale=scale,
            key=k_attn,
            inference=inference,
        )
        x = add_attention_and_mlp(
            x, attn_out, self.ln_2, self.mlp, self.resid_pdrop, (k_drop_attn, k_drop_mlp), inference
        )
        return x, cache


class Gpt2LMHeadModel(TiedHeadModel):
    """GPT-2 language model; the output head is the token embedding table (tied weights).

    Parameter tree (axes of each weight):
      token_embeddings.weight (vocab, embed); position_embeddings.weight (position, embed)
      blocks: nt.Stacked (leading `layers` axis on every weight below) or nt.BlockSeq (one per layer)
        ln_1.weight/bias, ln_2.weight/bias (embed)
        attn.q_proj/k_proj/v_proj.weight (heads|kv_heads, head_size, embed), .bias (heads|kv_heads, head_size)
        attn.o_proj.weight (embed, heads, head_size), .bias (embed)
        mlp.up.weight (mlp, embed), .bias (mlp); mlp.down.weight (embed, mlp), .bias (embed)
      ln_f.weight/bias (embed)
    """

    tied_embeddings = "token_embeddings"

    token_embeddings: Embedding
    position_embeddings: Embedding
    blocks: nt.Stacked | nt.BlockSeq
    ln_f: LayerNorm
    config: Gpt2StyleConfig = eqx.field(static=True)  # Backpack's config, when this is a Backpack's transformer
    Vocab: Axis = eqx.field(static=True)
    inference: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(Vocab: Axis, config: Gpt2StyleConfig, *, key: jax.Array) -> Gpt2LMHeadModel:
        """Fresh weights ~ Normal(0, initializer_range); residual outputs scaled by 1/sqrt(2 layers)."""
        k_tok, k_pos, k_blocks = jax.random.split(key, 3)
        std = config.initializer_range
        tokens = Embedding.init(Vocab, config.Embed, key=k_tok, init_scale=std)
        positions = Embedding.init(config.Pos, config.Embed, key=k_pos, init_scale=std / 2)
        blocks = build_blocks(config, lambda k: Gpt2Block.init(config, key=k), key=k_blocks)
        ln_f = LayerNorm.init(config.Embed, eps=config.layer_norm_epsilon, use_bias=config.use_bias)
        return Gpt2LMHeadModel(tokens, positions, blocks, ln_f, config, Vocab)

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
        """Final hidden states (after ln_f) and, when a cache is given, the updated cache."""
        input_ids = check_input_ids(input_ids, self.config.seq_len)
        positions = given_positions(input_ids, positions, cache_offset)
        k_embed, k_blocks = split_key(key, 2)
        x = self.token_embeddings.embed(input_ids) + self.position_embeddings.embed(positions)
        x = dropout(x, self.config.embed_pdrop, k_embed, self.inference)
        x, new_cache = run_layer_stack(
            self.blocks,
            x,
            attn_mask,
            positions,
            key=k_blocks,
            cache=cache,
            cache_offset=cache_offset,
            inference=self.inference,
            per_layer={"layer_index": nt.arange(self.config.Layers, dtype=x.dtype)},
        )
        return self.ln_f(x), new_cache

    def layer_stack(self) -> nt.Stacked | nt.BlockSeq:
        """The transformer blocks, run once by activations between the embeddings and ln_f."""
        return self.blocks

    def with_layer_stack(self, stack: Any) -> Gpt2LMHeadModel:
        """The same model running `stack` in place of its blocks."""
        return dataclasses.replace(self, blocks=stack)
