"""Gemma 1, 2 and 3: GeGLU, embeddings scaled by sqrt(hidden_dim), (1 + weight) RMSNorms, tied embeddings;
Gemma 2 adds post-norms, soft-capping and alternating local (sliding) and global layers; Gemma 3 adds q/k norms
and a RoPE theta of its own for the local layers."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import LmConfig, check_positive
from .decoder_config import DecoderConfig, DecoderSpec, layer_windows
from .rope import RopeConfig


@LmConfig.register_subclass("gemma")
@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    """Gemma hyperparameters (defaults: gemma-2b); the keys are Levanter's `gemma` keys.

    The MLP is GeGLU (`activation_function` gelu_pytorch_tanh, the same function as gelu_new).
    """

    seq_len: int = 8192
    hidden_dim: int = 2048
    intermediate_dim: int = 16384
    num_layers: int = 18
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int | None = 256
    activation_function: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    use_bias: bool = False
    """Biases on the q, k, v and output projections of attention (transformers' attention_bias)."""

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks with Gemma's norms and embedding scale."""
        return DecoderSpec(norm_offset=1.0, embed_scale=True, qkv_bias=self.use_bias, out_bias=self.use_bias)


@dataclass(frozen=True)
class _LocalGlobal(GemmaConfig):
    """Gemma 2/3's layer pattern: every `sliding_window_pattern`-th layer is global, the others local."""

    query_pre_attn_scalar: int = 256
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (instead of head_dim ** -0.5)."""
    sliding_window: int | None = 4096
    """Positions each query of a local layer sees (itself included); null: local layers attend fully too."""
    sliding_window_pattern: int = 2
    """Every this-many-th layer is global, the others local (2: local, global, local, ...)."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap * tanh(score / cap) with this cap; null: no capping."""
    final_logit_softcapping: float | None = None
    """Output logits become cap * tanh(logit / cap) with this cap; null: no capping."""

    def __post_init__(self) -> None:
        check_positive(self, "sliding_window_pattern")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{type(self).__name__}.{name} must be positive (or null), got {value!r}")
        super().__post_init__()

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) uses the sliding window."""
        return (layer + 1) % self.sliding_window_pattern != 0

    def local_global_spec(self, **extra) -> DecoderSpec:
        sliding = [self.is_local(i) for i in range(self.num_layers)]
        return DecoderSpec(
            norm_offset=1.0,
            embed_scale=True,
            post_attn_norm=True,
            post_mlp_norm=True,
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            attention_scale=float(self.query_pre_attn_scalar) ** -0.5,
            attn_logit_soft_cap=self.attn_logit_softcapping,
            final_logit_soft_cap=self.final_logit_softcapping,
            layer_windows=layer_windows(self.num_layers, self.sliding_window, sliding),
            **extra,
        )


@LmConfig.register_subclass("gemma2")
@dataclass(frozen=True)
class Gemma2Config(_LocalGlobal):
    """Gemma 2 hyperparameters (defaults: gemma-2-2b).

    Norms before and after attention and the MLP; scores scaled by query_pre_attn_scalar ** -0.5 and
    soft-capped at attn_logit_softcapping, logits at final_logit_softcapping; local (sliding_window) and
    global layers alternate, local first (sliding_window_pattern=2).
    """

    hidden_dim: int = 2304
    intermediate_dim: int = 9216
    num_layers: int = 26
    num_heads: int = 8
    num_kv_heads: int = 4
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0

    def decoder_spec(self) -> DecoderSpec:
        """Gemma 2's blocks."""
        return self.local_global_spec()


@LmConfig.register_subclass("gemma3")
@dataclass(frozen=True)
class Gemma3Config(_LocalGlobal):
    """Gemma 3 text hyperparameters (defaults: gemma-3-4b's text tower).

    Gemma 2's blocks with per-head q/k norms; five local layers then one global (sliding_window_pattern=6);
    global layers use `rope` (theta 1e6, with its scaling), local ones plain RoPE of theta rope_local_base_freq.
    No soft-capping by default.
    """

    seq_len: int = 131072
    hidden_dim: int = 2560
    intermediate_dim: int = 10240
    num_layers: int = 34
    num_heads: int = 8
    num_kv_heads: int = 4
    sliding_window: int | None = 1024
    sliding_window_pattern: int = 6
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=1e6))
    rope_local_base_freq: float = 10000.0
    """RoPE theta of the local (sliding-window) layers, which use plain RoPE; global layers use `rope`."""

    def decoder_spec(self) -> DecoderSpec:
        """Gemma 2's blocks with q/k norms and the local layers' own RoPE."""
        return self.local_global_spec(qk_norm="head", local_rope_theta=float(self.rope_local_base_freq))
