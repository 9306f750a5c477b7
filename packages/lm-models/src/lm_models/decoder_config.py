"""DecoderConfig and DecoderSpec: the config that Llama, Mistral, Mixtral, Qwen 2/3, Qwen3-MoE, Gemma 1/2/3 and
OLMo 2 derive from, without jax (the model, and how a spec shapes a block, are in lm_models.decoder)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import named_tensors as nt
from named_tensors import Axis

from .config import (
    LmConfig,
    check_activation,
    check_attn_backend,
    check_cross_entropy_block_size,
    check_layer_stack,
    check_positive,
    check_probability,
)
from .flops import attention_flops_per_token, config_matmul_weights, training_flops_per_token
from .rope import RopeConfig

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class DecoderSpec:
    """The static architecture of one decoder family, derived from its config."""

    # RMSNorm placement around attention and the MLP, and Gemma's (1 + weight) scale (norm_offset=1).
    pre_attn_norm: bool = True
    post_attn_norm: bool = False
    pre_mlp_norm: bool = True
    post_mlp_norm: bool = False
    norm_offset: float = 0.0
    # A learned scale in every RMSNorm; false: normalise only (Llama's use_layer_norm_weight).
    norm_weight: bool = True
    # Token embeddings times sqrt(hidden_dim) (Gemma), and cap * tanh(logits / cap) on the output (Gemma 2).
    embed_scale: bool = False
    final_logit_soft_cap: float | None = None
    # Biases of the q/k/v projections, the output projection and the MLP.
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    # RMSNorm on queries and keys: None, "head" (per head) or "all" (all heads together); see AttentionOptions.
    qk_norm: str | None = None
    attention_scale: float | None = None
    attn_logit_soft_cap: float | None = None
    # The sliding window of each layer (None: that layer attends to every earlier position); None for no window
    # anywhere. Layers with a window use `local_rope_theta` when it is set (Gemma 3's local layers).
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    # A mixture of `num_experts` gated experts, `experts_per_token` per token, instead of the dense MLP.
    num_experts: int | None = None
    experts_per_token: int = 2
    router_z_loss: bool = False
    moe_block_size: int = nt.DEFAULT_MOE_BLOCK_SIZE
    # Each expert's hidden width (None: intermediate_dim), and whether the k chosen router probabilities are
    # renormalised to sum to one (Qwen3-MoE's norm_topk_prob).
    expert_dim: int | None = None
    normalize_expert_weights: bool = True
    # Layers (from 0) that keep the dense MLP of intermediate_dim in a mixture-of-experts model (Qwen3-MoE's
    # decoder_sparse_step and mlp_only_layers). Such mixed layers differ in their parameters, so they are unrolled.
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: biases on the router and the experts, the experts' clamped SwiGLU (swiglu_limit, swiglu_alpha; see
    # named_tensors.nn.GatedExperts), and a learned sink logit per head in every attention softmax.
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    attention_sinks: bool = False
    # Llama 4: layers (from 0) without RoPE (NoPE), RoPE on interleaved pairs, chunked attention and an L2 norm of
    # queries and keys after RoPE on the other layers, temperature tuning (floor_scale, attn_scale) on the NoPE
    # layers (see AttentionOptions), and a mixture whose sigmoid weights scale the experts' inputs, with a shared
    # expert of expert_dim (named_tensors.nn.SharedExpertMoE).
    nope_layers: tuple[int, ...] = ()
    rope_interleaved: bool = False
    attention_chunk_size: int | None = None
    rope_qk_l2_norm: bool = False
    nope_temperature: tuple[float, float] | None = None
    shared_expert: bool = False

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has the mixture of experts rather than the dense MLP."""
        return self.num_experts is not None and layer not in self.dense_layers

    def mixed_layers(self, num_layers: int) -> bool:
        """Whether some of the num_layers layers are sparse and others dense."""
        return len({self.is_sparse(i) for i in range(num_layers)}) > 1


@dataclass(frozen=True)
class DecoderConfig(LmConfig):
    """The keys every decoder family shares (Levanter's Llama keys, plus `head_dim`); not a model type itself."""

    seq_len: int = 2048
    hidden_dim: int = 4096
    intermediate_dim: int = 11008
    """The gated MLP's hidden width (the size of the `mlp` axis)."""
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    """Key/value heads (grouped-query attention); must divide num_heads; equal to num_heads: plain multi-head."""
    head_dim: int | None = None
    """Features per attention head; null: hidden_dim / num_heads (the resolved config then holds that number)."""
    activation_function: str = "silu"
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-6
    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection too (no separate lm_head)."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary position embeddings: `rope.type` and its scaling keys below."""
    attn_pdrop: float = 0.0
    upcast_attn: bool = False
    gradient_checkpointing: bool | str = True
    scan_layers: bool = True
    scan_unroll: bool | int | str = "auto"
    use_flash_attention: bool = False
    flash_attention_block_size: int | None = None
    attn_backend: str = "default"
    cross_entropy_block_size: int | None = None

    def __post_init__(self) -> None:
        check_attn_backend(self)
        check_cross_entropy_block_size(self)
        name = type(self).__name__
        check_positive(self, "seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads")
        if self.head_dim is None and self.hidden_dim % self.num_heads:
            raise ValueError(
                f"{name}: num_heads={self.num_heads} does not divide hidden_dim={self.hidden_dim}; set head_dim"
            )
        if self.head_dim is None:  # one spelling of each head size, so that equal configs compare equal
            object.__setattr__(self, "head_dim", self.hidden_dim // self.num_heads)
        check_positive(self, "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{name}: num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}; each "
                "key/value head serves an equal group of query heads"
            )
        if self.HeadSize.size % 2:
            raise ValueError(f"{name}: the head size {self.HeadSize.size} must be even for rotary embeddings")
        if isinstance(self.rope, dict):  # built from a plain mapping (e.g. JSON) rather than by a config parser
            object.__setattr__(self, "rope", RopeConfig(**self.rope))
        check_probability(self, "attn_pdrop")
        check_layer_stack(self)
        check_activation(self)
        spec = self.decoder_spec()
        windows = spec.layer_windows
        if windows is not None:
            if len(windows) != self.num_layers:
                raise ValueError(f"{name}: {len(windows)} layer windows for num_layers={self.num_layers}")
            bad = [w for w in windows if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1)]
            if bad:
                raise ValueError(
                    f"{name}: sliding windows must be positive integers (or null for none), got {bad[0]!r}"
                )
        if spec.num_experts is not None and not 1 <= spec.experts_per_token <= spec.num_experts:
            raise ValueError(
                f"{name}: {spec.experts_per_token} experts per token must be between 1 and the {spec.num_experts} "
                "experts"
            )
        if spec.mixed_layers(self.num_layers) and self.scan_layers:
            dense = [i for i in range(self.num_layers) if not spec.is_sparse(i)]
            raise ValueError(
                f"{name}: layers {dense} have a dense MLP and the others a mixture of experts, so their parameters "
                "differ and one scan cannot run them; set scan_layers: false"
            )

    @abc.abstractmethod
    def decoder_spec(self) -> DecoderSpec:
        """This family's architecture."""

    @property
    def KVHeads(self) -> Axis:
        return Axis("kv_heads", self.num_kv_heads)

    @property
    def HeadSize(self) -> Axis:
        assert self.head_dim is not None  # __post_init__ fills in hidden_dim / num_heads for null
        return Axis("head_size", self.head_dim)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    @property
    def ExpertMlp(self) -> Axis:
        """The hidden axis of each expert (named `mlp`, like the dense MLP's, whose width it may not share)."""
        return Axis("mlp", self.decoder_spec().expert_dim or self.intermediate_dim)

    @property
    def Experts(self) -> Axis | None:
        """The experts axis of a mixture-of-experts family, else None."""
        n = self.decoder_spec().num_experts
        return None if n is None else Axis(nt.nn.EXPERTS, n)

    model_class = "lm_models.decoder:DecoderLMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token (lm_models.flops); a mixture of experts counts only the active experts."""
        spec = self.decoder_spec()
        weights = config_matmul_weights(self, vocab_size, num_kv_heads=self.num_kv_heads, mlp_matrices=0)
        for layer in range(self.num_layers):
            if spec.is_sparse(layer):
                assert spec.num_experts is not None  # is_sparse says there are experts
                expert_dim = spec.expert_dim or self.intermediate_dim
                weights += 3 * spec.experts_per_token * self.hidden_dim * expert_dim
                weights += self.hidden_dim * spec.num_experts  # the router
            else:
                weights += 3 * self.hidden_dim * self.intermediate_dim
        length = seq_len or self.seq_len
        attention = sum(
            attention_flops_per_token(
                num_layers=1,
                seq_len=length if window is None else min(window, length),
                num_heads=self.num_heads,
                head_size=self.HeadSize.size,
            )
            for window in (spec.layer_windows or (None,) * self.num_layers)
        )
        return training_flops_per_token(weights, attention)


def layer_windows(num_layers: int, window: int | None, sliding: list[bool] | tuple[bool, ...]) -> tuple | None:
    """Per-layer windows: `window` where `sliding` is true, None elsewhere; None when no layer has one."""
    if window is None or not any(sliding):
        return None
    return tuple(window if s else None for s in sliding)
