"""The decoder that Llama, Mistral, Mixtral, Qwen 2/3, Qwen3-MoE, Gemma 1/2/3, OLMo 2, gpt-oss and Llama 4 share: its
model (the config is in lm_models.decoder_config).

Each family is a dataclass with its own keys (Levanter's and Hugging Face's names) that derives from DecoderConfig
and describes its architecture as a DecoderSpec: pre-norm (or post-norm) blocks with RMSNorm, RoPE, grouped-query
attention and a gated MLP (or a mixture of gated experts). One block is
x + post_attn_norm(attn(pre_attn_norm(x))) then x + post_mlp_norm(mlp(pre_mlp_norm(x))), where each norm is
present or not per family. Layers that differ (Gemma's local and global layers, Qwen's windowed upper layers) have
the same parameters, so they stay one scanned stack: what differs per layer, the sliding window and which RoPE to
use, is a per-layer input of the scan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import (
    ROUTER_LOAD,
    Embedding,
    GatedMLP,
    GroupLimitedMoE,
    Linear,
    MixtureOfExperts,
    RMSNorm,
    RotaryEmbeddings,
    SharedExpertMoE,
)

from .attention import Attention, AttentionOptions
from .config import checkpoint_policy
from .decoder_config import DecoderConfig, DecoderSpec
from .kv_cache import KVCache
from .model import LmHeadModel, check_input_ids, given_positions, split_key
from .rope import rotary_embeddings
from .stacking import build_blocks


def attention_options(config: DecoderConfig, spec: DecoderSpec) -> AttentionOptions:
    """The attention settings of a decoder family."""
    windows = set(spec.layer_windows or (None,))
    rotary = rotary_embeddings(config.rope, config.HeadSize.size)
    if spec.rope_interleaved:
        rotary = RotaryEmbeddings(rotary.head_size, rotary.theta, rotary.scaling, interleaved=True)
    local_rotary = None
    if spec.local_rope_theta is not None and windows != {None}:
        # Layers with a window use the local RoPE (Gemma 3): every layer, or those a per-layer flag marks.
        local_rotary = RotaryEmbeddings(config.HeadSize.size, spec.local_rope_theta)
        if None not in windows:
            rotary, local_rotary = local_rotary, None
    return AttentionOptions.of_config(
        config,
        use_bias=spec.qkv_bias,
        out_bias=spec.out_bias,
        rotary=rotary,
        local_rotary=local_rotary,
        qk_norm=spec.qk_norm,
        qk_norm_eps=config.layer_norm_epsilon,
        qk_norm_offset=spec.norm_offset,
        scale=spec.attention_scale,
        logits_soft_cap=spec.attn_logit_soft_cap,
        sinks=spec.attention_sinks,
        # One window for every layer is static; differing windows are per-layer inputs (see per_layer_inputs).
        sliding_window=next(iter(windows)) if len(windows) == 1 else None,
        layer_windows=tuple(sorted({w or 0 for w in windows})) if len(windows) > 1 else None,
        chunk_size=spec.attention_chunk_size,
        rope_qk_l2_norm=spec.rope_qk_l2_norm,
        nope_temperature=spec.nope_temperature,
    )


def per_layer_inputs(config: DecoderConfig, spec: DecoderSpec) -> dict[str, NamedArray]:
    """What the scan gives each layer: its window (0: none) and whether it is local, when layers differ, and
    whether it goes without RoPE, when some layers do (Llama 4)."""
    windows = spec.layer_windows
    Layers = config.Layers
    out = {}
    if windows is not None and len(set(windows)) > 1:
        out["window"] = nt.named(jnp.asarray([w or 0 for w in windows], jnp.int32), (Layers,))
        if spec.local_rope_theta is not None:
            out["local"] = nt.named(jnp.asarray([w is not None for w in windows]), (Layers,))
    if spec.nope_layers:
        out["nope"] = nt.named(jnp.asarray([i in spec.nope_layers for i in range(config.num_layers)]), (Layers,))
    return out


class DecoderBlock(eqx.Module):
    """One decoder layer; absent norms are None (see the module docstring for the order)."""

    pre_attn_norm: RMSNorm | None
    self_attn: Attention
    post_attn_norm: RMSNorm | None
    pre_mlp_norm: RMSNorm | None
    mlp: GatedMLP | MixtureOfExperts | SharedExpertMoE
    post_mlp_norm: RMSNorm | None
    # The auxiliary losses a dense layer reports as zeros, so that it returns what the sparse layers of a mixed
    # model return (the unrolled stack gathers every layer's losses).
    zero_aux: tuple[str, ...] = eqx.field(static=True, default=())
    # The experts of the sparse layers, whose load (ROUTER_LOAD) a dense layer of a mixed model reports as zeros.
    zero_load: int = eqx.field(static=True, default=0)

    @staticmethod
    def init(config: DecoderConfig, *, key: jax.Array, layer: int = 0) -> DecoderBlock:
        """Block `layer` (which decides dense or sparse in a mixed model) with fresh weights."""
        c, spec = config, config.decoder_spec()
        k_attn, k_mlp = jax.random.split(key)
        std = c.initializer_range

        def norm(present: bool) -> RMSNorm | None:
            if not present:
                return None
            return RMSNorm.init(
                c.Embed, eps=c.layer_norm_epsilon, use_weight=spec.norm_weight, weight_offset=spec.norm_offset
            )

        zero_aux: tuple[str, ...] = ()
        zero_load = 0
        if not spec.is_sparse(layer):
            if spec.mixed_layers(c.num_layers):
                zero_aux = ("router_aux_loss", "router_z_loss") if spec.router_z_loss else ("router_aux_loss",)
                zero_load = spec.num_experts or 0
            k_gate, k_up, k_down = jax.random.split(k_mlp, 3)

            def linear(In, Out, k) -> Linear:
                return Linear.init(In, Out, key=k, use_bias=spec.mlp_bias, init_scale=std, scale_by_fan_in=False)

            mlp = GatedMLP(
                linear(c.Embed, c.Mlp, k_gate),
                linear(c.Embed, c.Mlp, k_up),
                linear(c.Mlp, c.Embed, k_down),
                c.activation_function,
            )
        elif spec.shared_expert:
            assert c.Experts is not None  # a sparse layer: the spec has experts
            mlp = SharedExpertMoE.init(
                c.Embed, c.Experts, c.ExpertMlp, spec.experts_per_token, key=k_mlp, activation=c.activation_function,
                init_scale=std, block_size=spec.moe_block_size,
            )  # fmt: skip
        else:
            assert c.Experts is not None  # a sparse layer: the spec has experts
            mlp = MixtureOfExperts.init(
                c.Embed,
                c.Experts,
                c.ExpertMlp,
                spec.experts_per_token,
                key=k_mlp,
                activation=c.activation_function,
                init_scale=std,
                z_loss=spec.router_z_loss,
                block_size=spec.moe_block_size,
                normalize_weights=spec.normalize_expert_weights,
                router_bias=spec.router_bias,
                expert_bias=spec.expert_bias,
                swiglu_limit=spec.swiglu_limit,
                swiglu_alpha=spec.swiglu_alpha,
            )
        attn = Attention.init(attention_options(c, spec), key=k_attn, init_std=std, output_init_std=std)
        return DecoderBlock(
            norm(spec.pre_attn_norm), attn, norm(spec.post_attn_norm), norm(spec.pre_mlp_norm), mlp,
            norm(spec.post_mlp_norm), zero_aux, zero_load,
        )  # fmt: skip

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
        window: NamedArray | None = None,
        local: NamedArray | None = None,
        nope: NamedArray | None = None,
    ) -> tuple[NamedArray, tuple[KVCache | None, dict[str, jax.Array]]]:
        """The new x, and (this layer's updated cache or None, this layer's auxiliary losses)."""
        h = x if self.pre_attn_norm is None else self.pre_attn_norm(x)
        h, cache = self.self_attn(
            h,
            mask,
            positions,
            cache=cache,
            cache_offset=cache_offset,
            key=key,
            inference=inference,
            window=None if window is None else window.array,
            local=None if local is None else local.array,
            nope=None if nope is None else nope.array,
        )
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x, aux = mlp_residual(self, x + h, self.post_mlp_norm)
        return nt.shard(x), (cache, aux)


def mlp_residual(block: Any, x: NamedArray, post_mlp_norm: RMSNorm | None = None) -> tuple[NamedArray, dict[str, Any]]:
    """A block's second half, x + post_mlp_norm(mlp(pre_mlp_norm(x))) (absent norms skipped), and the layer's
    auxiliary losses: the mixture's, or the zeros a dense layer of a mixed model reports (block.zero_aux,
    block.zero_load); shared by DecoderBlock and the families' own blocks (DeepSeek-V3's)."""
    h = x if block.pre_mlp_norm is None else block.pre_mlp_norm(x)
    if isinstance(block.mlp, MixtureOfExperts | SharedExpertMoE | GroupLimitedMoE):
        h, aux = block.mlp(h)
    else:
        h = block.mlp(h)
        aux = dense_layer_aux(block.zero_aux, block.zero_load)
    if post_mlp_norm is not None:
        h = post_mlp_norm(h)
    return x + h, aux


def dense_layer_aux(names: tuple[str, ...], num_experts: int) -> dict[str, jax.Array]:
    """What a dense layer of a mixed model reports: zero losses, and a zero load over num_experts (0: none)."""
    aux = {name: jnp.zeros((), jnp.float32) for name in names}
    if num_experts:
        aux[ROUTER_LOAD] = jnp.zeros((num_experts,), jnp.float32)
    return aux


def layer_aux(aux: dict[str, jax.Array], sparse: list[int], num_layers: int) -> dict[str, jax.Array]:
    """The stack's auxiliary outputs, stacked along the layers: each loss's mean over the `sparse` layers (dense
    layers of a mixed model report zeros), and the sparse layers' rows of ROUTER_LOAD."""
    out = {}
    for name, value in aux.items():
        if name == ROUTER_LOAD:
            out[name] = value if len(sparse) == num_layers else value[jnp.asarray(sparse)]
        elif len(sparse) < num_layers:
            out[name] = jnp.sum(value) / len(sparse)
        else:
            out[name] = jnp.mean(value)
    return out


class DecoderLMHeadModel(LmHeadModel):
    """A decoder language model (Llama, Mistral, Mixtral, Qwen, Qwen3-MoE, Gemma, OLMo 2); `config` says which.

    Parameter tree (axes of each weight):
      embed_tokens.weight (vocab, embed)
      blocks: nt.Stacked (leading `layers` axis on every weight below) or nt.BlockSeq (one per layer)
        pre_attn_norm / post_attn_norm / pre_mlp_norm / post_mlp_norm .weight (embed), each when the family has it
          (a norm without a learned scale, Llama's use_layer_norm_weight=false, has weight None)
        self_attn.q_proj.weight (heads, head_size, embed); k_proj/v_proj.weight (kv_heads, head_size, embed)
        self_attn.o_proj.weight (embed, heads, head_size); biases over the output axes, when the family has them
        self_attn.q_norm.weight, k_norm.weight (head_size), or (heads|kv_heads, head_size) for OLMo 2
        mlp.gate.weight, mlp.up.weight (mlp, embed); mlp.down.weight (embed, mlp), or with experts:
        mlp.router.weight (experts, embed); mlp.experts.gate, .up (experts, mlp, embed); .down (experts, embed, mlp)
        (and Llama 4's shared expert, mlp.shared.gate/.up/.down.weight, as the dense MLP's)
      norm.weight (embed)
      lm_head.weight (vocab, embed), or lm_head None when tied
    """

    embed_tokens: Embedding
    blocks: nt.Stacked | nt.BlockSeq
    norm: RMSNorm
    lm_head: Linear | None
    config: DecoderConfig = eqx.field(static=True)
    Vocab: Axis = eqx.field(static=True)
    inference: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(Vocab: Axis, config: DecoderConfig, *, key: jax.Array) -> DecoderLMHeadModel:
        """Fresh weights: every weight ~ Normal(0, initializer_range) and norms at a scale of one."""
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        c, spec = config, config.decoder_spec()
        embed = Embedding.init(Vocab, c.Embed, key=k_embed, init_scale=c.initializer_range)
        if spec.mixed_layers(c.num_layers):
            # Dense and sparse layers differ in their parameters: one module per layer (the config checked that
            # scan_layers is off), from the per-layer keys that BlockSeq.init would split.
            keys = jax.random.split(k_blocks, c.num_layers)
            made = tuple(DecoderBlock.init(c, key=k, layer=i) for i, k in enumerate(keys))
            blocks = nt.BlockSeq(made, c.Layers, checkpoint_policy(c.gradient_checkpointing))
        else:
            blocks = build_blocks(c, lambda k: DecoderBlock.init(c, key=k), key=k_blocks)
        norm = RMSNorm.init(
            c.Embed, eps=c.layer_norm_epsilon, use_weight=spec.norm_weight, weight_offset=spec.norm_offset
        )
        lm_head = None
        if not c.tie_word_embeddings:
            lm_head = Linear.init(
                c.Embed, Vocab, key=k_head, use_bias=False, init_scale=c.initializer_range, scale_by_fan_in=False
            )
        return DecoderLMHeadModel(embed, blocks, norm, lm_head, c, Vocab)

    def _run(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None,
        key: jax.Array | None,
        cache: KVCache | None,
        cache_offset: jax.Array | int,
        positions: NamedArray | None,
    ) -> tuple[NamedArray, KVCache | None, dict[str, jax.Array]]:
        input_ids = check_input_ids(input_ids, None)
        spec = self.config.decoder_spec()
        positions = given_positions(input_ids, positions, cache_offset)
        (k_blocks,) = split_key(key, 1)
        x = self.embed_tokens.embed(input_ids)
        if spec.embed_scale:
            # As transformers: the scale rounded to the embeddings' dtype first.
            x = x * jnp.asarray(math.sqrt(self.config.hidden_dim), x.dtype)
        per_layer: dict[str, Any] = per_layer_inputs(self.config, spec)
        if cache is not None:
            per_layer["cache"] = cache
        x, (new_cache, aux) = self.blocks.scan(
            nt.shard(x),
            attn_mask,
            positions,
            key=k_blocks,
            per_layer=per_layer,
            inference=self.inference,
            cache_offset=cache_offset,
        )
        sparse = [i for i in range(self.config.num_layers) if spec.is_sparse(i)]
        return self.norm(x), (new_cache if cache is not None else None), layer_aux(aux, sparse, self.config.num_layers)

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
        """Final hidden states (after the last norm) and, when a cache is given, the updated cache.

        `positions` replaces 0, 1, 2, ... as each token's position (RoPE angles, windows), as for Llama."""
        hidden, new_cache, _ = self._run(input_ids, attn_mask, key, cache, cache_offset, positions)
        return hidden, new_cache

    def activations_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        positions: NamedArray | None = None,
        router_load: bool = False,
    ) -> tuple[NamedArray, dict[str, jax.Array]]:
        """Final hidden states and the auxiliary losses of a mixture of experts (their mean over layers); with
        router_load, also ROUTER_LOAD: each sparse layer's expert load, (sparse layers, experts)."""
        hidden, _, aux = self._run(input_ids, attn_mask, key, None, 0, positions)
        if not router_load:
            aux.pop(ROUTER_LOAD, None)
        return hidden, aux

    def logits_from_activations(self, hidden: NamedArray) -> NamedArray:
        """The output head, then Gemma 2's final soft cap where the family has one."""
        return nt.nn.soft_cap(super().logits_from_activations(hidden), self.logits_soft_cap())

    def logits_soft_cap(self) -> float | None:
        """The cap of cap * tanh(logits / cap) on the output logits, or None."""
        return self.config.decoder_spec().final_logit_soft_cap

    def unembedding(self) -> NamedArray:
        """The output head (vocab, embed): lm_head's weight, or the token embeddings when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def layer_stack(self) -> nt.Stacked | nt.BlockSeq:
        """The decoder blocks, run once by _run between the embedding and the final norm."""
        return self.blocks

    def with_layer_stack(self, stack: Any) -> DecoderLMHeadModel:
        """The same model running `stack` in place of its blocks."""
        return dataclasses.replace(self, blocks=stack)
