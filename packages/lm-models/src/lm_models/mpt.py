"""MPT: ALiBi instead of position embeddings, no biases anywhere, optional clip_qkv, tied embeddings.

The semantics follow Hugging Face's MptForCausalLM: LayerNorms with a weight and no bias, an exact-GELU
MLP, ALiBi slopes from `alibi_bias_max`, and q, k and v clamped to [-clip_qkv, clip_qkv] when set.
"""

from __future__ import annotations

import equinox as eqx
import jax

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import MLP, Embedding, LayerNorm

from .attention import Attention
from .kv_cache import KVCache
from .model import (
    TiedHeadModel,
    absolute_positions,
    check_input_ids,
    dropout,
    run_layer_stack,
    split_key,
)
from .mpt_config import MptConfig
from .residual import add_attention_and_mlp, two_matrix_mlp
from .stacking import build_blocks


class MptBlock(eqx.Module):
    """x + attn(norm_1(x)), then + ffn(norm_2(x)); dropout on each residual branch."""

    norm_1: LayerNorm
    attn: Attention
    norm_2: LayerNorm
    ffn: MLP
    resid_pdrop: float = eqx.field(static=True)

    @staticmethod
    def init(config: MptConfig, *, key: jax.Array) -> MptBlock:
        """One block with fresh weights."""
        c = config
        k_attn, k_up, k_down = jax.random.split(key, 3)
        std = c.initializer_range

        def norm() -> LayerNorm:
            return LayerNorm.init(c.Embed, eps=c.layer_norm_epsilon, use_bias=False)

        ffn = two_matrix_mlp(
            c.Embed,
            c.Mlp,
            c.activation_function,
            keys=(k_up, k_down),
            use_bias=False,
            init_std=std,
            output_init_std=std,
        )
        attn = Attention.init(c.attention_options(), key=k_attn, init_std=std, output_init_std=std)
        return MptBlock(norm(), attn, norm(), ffn, c.resid_pdrop)

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
        k_attn, k_drop_attn, k_drop_mlp = split_key(key, 3)
        attn_out, cache = self.attn(
            self.norm_1(x), mask, positions, cache=cache, cache_offset=cache_offset, key=k_attn, inference=inference
        )
        x = add_attention_and_mlp(
            x, attn_out, self.norm_2, self.ffn, self.resid_pdrop, (k_drop_attn, k_drop_mlp), inference
        )
        return x, cache


class MptLMHeadModel(TiedHeadModel):
    """MPT language model; the output head is the token embedding table (tied weights).

    Parameter tree (axes of each weight; no biases anywhere):
      wte.weight (vocab, embed)
      blocks: nt.Stacked (leading `layers` axis on every weight below) or nt.BlockSeq (one per layer)
        norm_1.weight, norm_2.weight (embed)
        attn.q_proj.weight (heads, head_size, embed); attn.k_proj/v_proj.weight (kv_heads, head_size, embed)
        attn.o_proj.weight (embed, heads, head_size)
        ffn.up.weight (mlp, embed); ffn.down.weight (embed, mlp)
      norm_f.weight (embed)
    """

    tied_embeddings = "wte"

    wte: Embedding
    blocks: nt.Stacked | nt.BlockSeq
    norm_f: LayerNorm
    config: MptConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)
    inference: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(Vocab: Axis, config: MptConfig, *, key: jax.Array) -> MptLMHeadModel:
        """Fresh weights: every weight ~ Normal(0, initializer_range) and norms at one."""
        k_embed, k_blocks = jax.random.split(key)
        c = config
        wte = Embedding.init(Vocab, c.Embed, key=k_embed, init_scale=c.initializer_range)
        blocks = build_blocks(c, lambda k: MptBlock.init(c, key=k), key=k_blocks)
        norm_f = LayerNorm.init(c.Embed, eps=c.layer_norm_epsilon, use_bias=False)
        return MptLMHeadModel(wte, blocks, norm_f, c, Vocab)

    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_offset: jax.Array | int = 0,
    ) -> tuple[NamedArray, KVCache | None]:
        """Final hidden states (after norm_f) and, when a cache is given, the updated cache."""
        input_ids = check_input_ids(input_ids, None)
        positions = absolute_positions(input_ids, cache_offset)
        k_embed, k_blocks = split_key(key, 2)
        x = dropout(self.wte.embed(input_ids), self.config.embed_pdrop, k_embed, self.inference)
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
        return self.norm_f(x), new_cache
