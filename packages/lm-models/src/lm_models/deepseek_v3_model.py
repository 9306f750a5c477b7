"""The DeepSeek-V3 model: the shared decoder's stack and head around blocks of latent attention and a dense MLP
or DeepSeek's mixture of experts (the config is in lm_models.deepseek_v3)."""

from __future__ import annotations

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import (
    Embedding,
    GatedMLP,
    GroupLimitedMoE,
    LatentAttention,
    LatentCache,
    Linear,
    RMSNorm,
    balance_bias_update,
)

from .config import checkpoint_policy
from .decoder import DecoderLMHeadModel, mlp_residual
from .deepseek_v3 import DeepseekV3Config
from .deepseek_v3_mtp import MTP_LOSS, MtpDepth, mtp_loss
from .kv_cache import KEY_POSITION
from .model import POSITION, stacked_cache
from .rope import rotary_embeddings
from .stacking import build_blocks

MTP_KEY = 0x4D5450  # folded into the model's key for the MTP depths' weights and dropout
# The norms inside latent attention have transformers' fixed epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class DeepseekV3Block(eqx.Module):
    """One DeepSeek-V3 layer: x + attn(norm(x)), then x + mlp(norm(x)), the MLP dense or a mixture."""

    pre_attn_norm: RMSNorm
    self_attn: LatentAttention
    pre_mlp_norm: RMSNorm
    mlp: GatedMLP | GroupLimitedMoE
    # What a dense layer of a mixed model reports, so that every layer returns the same auxiliary losses.
    zero_aux: tuple[str, ...] = eqx.field(static=True, default=())
    zero_load: int = eqx.field(static=True, default=0)

    @staticmethod
    def init(config: DeepseekV3Config, *, key: jax.Array, layer: int = 0) -> DeepseekV3Block:
        """Block `layer` (dense below first_k_dense_replace, else sparse) with fresh weights."""
        c = config
        std = c.initializer_range
        k_attn, k_mlp = jax.random.split(key)
        attn = LatentAttention.init(
            c.Embed, c.Heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_dim=c.qk_nope_head_dim,
            qk_rope_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            rotary=rotary_embeddings(c.rope, c.qk_rope_head_dim), key=k_attn, scale=c.attention_scale(),
            interleave=c.rope_interleave, use_bias=c.attention_bias, norm_eps=LATENT_NORM_EPS,
            dropout_rate=c.attn_pdrop, init_scale=std,
        )  # fmt: skip
        zero_aux: tuple[str, ...] = ()
        zero_load = 0
        mlp: GatedMLP | GroupLimitedMoE
        if layer < c.first_k_dense_replace:
            if 0 < c.first_k_dense_replace < c.num_layers:
                zero_aux, zero_load = ("router_aux_loss",), c.n_routed_experts
            mlp = GatedMLP.init(c.Embed, c.Mlp, c.Embed, key=k_mlp, activation=c.activation_function, init_scale=std)
        else:
            assert c.Experts is not None  # DeepseekV3Config always has routed experts
            mlp = GroupLimitedMoE.init(
                c.Embed, c.Experts, c.ExpertMlp, c.num_experts_per_tok, key=k_mlp, num_shared=c.n_shared_experts,
                num_groups=c.n_group, top_groups=c.topk_group, normalize_weights=c.norm_topk_prob,
                scaling_factor=c.routed_scaling_factor, activation=c.activation_function, init_scale=std,
                block_size=c.moe_block_size,
            )  # fmt: skip

        def norm() -> RMSNorm:
            return RMSNorm.init(c.Embed, eps=c.layer_norm_epsilon)

        return DeepseekV3Block(norm(), attn, norm(), mlp, zero_aux, zero_load)

    def __call__(
        self,
        x: NamedArray,
        mask: NamedArray | nt.nn.AttentionMask | None,
        positions: NamedArray,
        *,
        key: jax.Array | None,
        inference: bool,
        cache_offset: jax.Array | int,
        cache: LatentCache | None = None,
        window: NamedArray | None = None,
        local: NamedArray | None = None,
    ) -> tuple[NamedArray, tuple[LatentCache | None, dict[str, jax.Array]]]:
        """The new x, and (this layer's updated cache or None, this layer's auxiliary losses); DecoderBlock's
        signature (DeepSeek-V3 has no per-layer windows: `window` and `local` are unused)."""
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(
                "DeepSeek-V3 decodes through the latent cache that model.init_cache makes, not a "
                f"{type(cache).__name__}"
            )
        segments, explicit = nt.nn.split_mask(mask)
        if segments is not None:
            assert isinstance(mask, nt.nn.AttentionMask)  # split_mask finds segment ids only in an AttentionMask
            explicit = mask.materialize(POSITION, KEY_POSITION)
        h, cache = self.self_attn(
            self.pre_attn_norm(x), positions, explicit, cache=cache, cache_offset=cache_offset, key=key,
            inference=inference,
        )  # fmt: skip
        x, aux = mlp_residual(self, x + h)
        return nt.shard(x), (cache, aux)


class DeepseekV3LMHeadModel(DecoderLMHeadModel):
    """DeepSeek-V3: DecoderLMHeadModel's embeddings, stack, final norm and head over DeepseekV3Blocks.

    Parameter tree, per block (blocks: nt.Stacked when every layer is of one kind, else nt.BlockSeq):
      pre_attn_norm.weight, pre_mlp_norm.weight (embed)
      self_attn: LatentAttention (q_a_proj, q_a_norm, q_b_proj or q_proj; kv_a_proj, k_rope_proj, kv_a_norm,
        kv_b_proj, o_proj; see its docstring for the layouts)
      mlp: GatedMLP (gate, up (mlp, embed); down (embed, mlp)) in the first_k_dense_replace layers, else
        GroupLimitedMoE (router.weight (experts, embed), correction_bias (experts), experts.gate/.up
        (experts, mlp, embed), experts.down (experts, embed, mlp), shared: a GatedMLP)
    The decoding cache holds each layer's latents (LatentCache), not per-head keys and values; the paged cache of
    serving does not hold latents yet, so supports_paging(model) is false.
    """

    supports_paged_cache: ClassVar[bool] = False
    # Multi-token prediction depths (mtp_depth of them; none by default), exported as DeepSeek-V3's release has them.
    mtp: tuple[MtpDepth, ...] = ()

    @staticmethod
    def init(Vocab: Axis, config: DeepseekV3Config, *, key: jax.Array) -> DeepseekV3LMHeadModel:  # type: ignore[override]
        """Fresh weights: every weight ~ Normal(0, initializer_range), norms at one, correction biases zero."""
        c = config
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        embed = Embedding.init(Vocab, c.Embed, key=k_embed, init_scale=c.initializer_range)
        if 0 < c.first_k_dense_replace < c.num_layers:
            # Dense and sparse layers differ in their parameters: one module per layer (scan_layers is off).
            keys = jax.random.split(k_blocks, c.num_layers)
            made = tuple(DeepseekV3Block.init(c, key=k, layer=i) for i, k in enumerate(keys))
            blocks = nt.BlockSeq(made, c.Layers, checkpoint_policy(c.gradient_checkpointing))
        else:
            layer = 0 if c.first_k_dense_replace else c.num_layers - 1  # every layer dense, or every one sparse
            blocks = build_blocks(c, lambda k: DeepseekV3Block.init(c, key=k, layer=layer), key=k_blocks)
        norm = RMSNorm.init(c.Embed, eps=c.layer_norm_epsilon)
        lm_head = None
        if not c.tie_word_embeddings:
            lm_head = Linear.init(
                c.Embed, Vocab, key=k_head, use_bias=False, init_scale=c.initializer_range, scale_by_fan_in=False
            )
        mtp = ()
        if c.mtp_depth:  # its own keys, so that a model without MTP draws the same weights as before
            keys = jax.random.split(jax.random.fold_in(key, MTP_KEY), c.mtp_depth)
            last = c.num_layers - 1
            mtp = tuple(
                MtpDepth.init(c, DeepseekV3Block.init(c, key=jax.random.fold_in(k, 1), layer=last), key=k) for k in keys
            )
        return DeepseekV3LMHeadModel(embed, blocks, norm, lm_head, c, Vocab, mtp=mtp)

    def activations_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        positions: NamedArray | None = None,
        router_load: bool = False,
    ) -> tuple[NamedArray, dict[str, jax.Array]]:
        """DecoderLMHeadModel's, plus with mtp_depth > 0 the multi-token prediction loss `mtp_loss` (lm_models.
        deepseek_v3_mtp.mtp_loss), which the config weights by mtp_loss_weight."""
        hidden, aux = super().activations_and_aux(
            input_ids, attn_mask, key=key, positions=positions, router_load=router_load
        )
        if self.mtp:
            if positions is not None:
                # lm-train refuses these runs before they start (LmConfig.needs_plain_positions); this is for others.
                raise ValueError(
                    "DeepSeek-V3's multi-token prediction scores the tokens ahead in one unpacked sequence; it cannot "
                    "take reordered or restarting positions (packed sequences, context parallelism): set mtp_depth: 0"
                )
            mtp_key = None if key is None else jax.random.fold_in(key, MTP_KEY)
            aux[MTP_LOSS] = mtp_loss(self, hidden, input_ids, attn_mask, mtp_key)
        return hidden, aux

    def balances_routing(self) -> bool:
        """Whether the train step moves the correction biases from the load (bias_update_speed > 0)."""
        c = self.config
        assert isinstance(c, DeepseekV3Config)
        return bool(c.bias_update_speed) and c.first_k_dense_replace < c.num_layers

    def routing_biases(self) -> list[NamedArray]:
        """The sparse layers' correction biases: one (layers, experts) array for a scanned stack, else one
        (experts,) array per sparse layer, in layer order."""
        if isinstance(self.blocks, nt.Stacked):
            return [self.blocks.stacked.mlp.correction_bias]
        return [b.mlp.correction_bias for b in self.blocks.blocks if isinstance(b.mlp, GroupLimitedMoE)]

    def balance_routing(self, before: DeepseekV3LMHeadModel, load: jax.Array) -> DeepseekV3LMHeadModel:
        """This model with each correction bias set to `before`'s moved by DeepSeek-V3's aux-loss-free rule
        (nt.nn.balance_bias_update at bias_update_speed), from the sparse layers' expert loads (layers, experts)
        of the step; whatever else changed the bias (an optimizer's update) is dropped."""
        c = self.config
        assert isinstance(c, DeepseekV3Config)
        old = before.routing_biases()
        if isinstance(self.blocks, nt.Stacked):
            load_rows = [nt.named(load, old[0].axis_names)]
        else:
            load_rows = [nt.named(load[i], bias.axis_names) for i, bias in enumerate(old)]
        new = [balance_bias_update(b, row, c.bias_update_speed) for b, row in zip(old, load_rows, strict=True)]
        return eqx.tree_at(lambda m: m.routing_biases(), self, new)

    def init_cache(self, batch_axes: tuple[Axis, ...], max_length: int, dtype: Any = jnp.float32) -> LatentCache:
        """An empty latent cache for every layer: latent (layers, *batch_axes, key_position, kv_lora) and
        rope_key (layers, *batch_axes, key_position, qk_rope)."""
        c = self.config
        assert isinstance(c, DeepseekV3Config)
        one = LatentCache.zeros(
            batch_axes, Axis(KEY_POSITION, max_length), Axis("kv_lora", c.kv_lora_rank),
            Axis("qk_rope", c.qk_rope_head_dim), dtype=dtype,
        )  # fmt: skip
        return stacked_cache(c.Layers, one)  # type: ignore[arg-type]
