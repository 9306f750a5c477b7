"""Llama's config, without jax: the model is in lm_models.llama."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from named_tensors import Axis

from .config import (
    LmConfig,
    check_activation,
    check_attn_backend,
    check_cross_entropy_block_size,
    check_heads_divide,
    check_layer_stack,
    check_positive,
    check_probability,
)
from .flops import attention_flops_per_token, training_flops_per_token, transformer_matmul_weights
from .rope import RopeConfig, rotary_embeddings

if TYPE_CHECKING:
    from .attention import AttentionOptions


@LmConfig.register_subclass("llama")
@dataclass(frozen=True)
class LlamaConfig(LmConfig):
    """Llama hyperparameters; the keys are Levanter's `llama` model keys."""

    seq_len: int = 2048
    hidden_dim: int = 4096
    intermediate_dim: int = 11008
    """The gated MLP's hidden width (the size of the `mlp` axis)."""
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    """Key/value heads (grouped-query attention); must divide num_heads; equal to num_heads: plain multi-head."""
    activation_function: str = "silu"
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection too (no separate lm_head)."""
    use_bias: bool = False
    """Biases on the attention and MLP projections."""
    use_layer_norm_weight: bool = True
    """A learned scale in every RMSNorm; false: normalise only."""
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
        check_positive(self, "seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads")
        check_heads_divide(self)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}; "
                "each key/value head serves an equal group of query heads"
            )
        if (self.hidden_dim // self.num_heads) % 2:
            raise ValueError(
                f"LlamaConfig: the head size hidden_dim / num_heads = {self.hidden_dim // self.num_heads} "
                "must be even for rotary embeddings"
            )
        if isinstance(self.rope, dict):  # built from a plain mapping (e.g. JSON) rather than by a config parser
            object.__setattr__(self, "rope", RopeConfig(**self.rope))
        check_probability(self, "attn_pdrop")
        check_layer_stack(self)
        check_activation(self)

    @property
    def KVHeads(self) -> Axis:
        return Axis("kv_heads", self.num_kv_heads)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    def attention_options(self) -> AttentionOptions:
        """The attention layer's settings for this config."""
        from .attention import AttentionOptions

        return AttentionOptions(
            Embed=self.Embed,
            Heads=self.Heads,
            KVHeads=self.KVHeads,
            HeadSize=self.HeadSize,
            use_bias=self.use_bias,
            upcast_softmax=self.upcast_attn,
            dropout_rate=self.attn_pdrop,
            rotary=rotary_embeddings(self.rope, self.HeadSize.size),
            use_flash_attention=self.use_flash_attention,
            flash_block_size=self.flash_attention_block_size,
            backend=self.attn_backend,
        )

    model_class = "lm_models.llama:LlamaLMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token (see lm_models.flops for the formula)."""
        weights = transformer_matmul_weights(
            hidden_dim=self.hidden_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.HeadSize.size,
            mlp_dim=self.intermediate_dim,
            mlp_matrices=3,
            vocab_size=vocab_size,
        )
        attention = attention_flops_per_token(
            num_layers=self.num_layers,
            seq_len=seq_len or self.seq_len,
            num_heads=self.num_heads,
            head_size=self.HeadSize.size,
        )
        return training_flops_per_token(weights, attention)
