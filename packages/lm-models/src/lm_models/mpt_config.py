"""MPT's config, without jax: the model is in lm_models.mpt."""

from __future__ import annotations

from dataclasses import dataclass
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

if TYPE_CHECKING:
    from .attention import AttentionOptions


@LmConfig.register_subclass("mpt")
@dataclass(frozen=True)
class MptConfig(LmConfig):
    """MPT hyperparameters; `intermediate_dim` overrides `expansion_ratio * hidden_dim` when set."""

    seq_len: int = 2048
    hidden_dim: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    expansion_ratio: int = 4
    """The MLP's hidden width as a multiple of hidden_dim (unless intermediate_dim is set)."""
    intermediate_dim: int | None = None
    """The MLP's hidden width; null: expansion_ratio * hidden_dim."""
    clip_qkv: float | None = None
    """Clamp queries, keys and values to [-clip_qkv, clip_qkv]; null: no clamping."""
    alibi_bias_max: float = 8.0
    """ALiBi's steepest exponent: head h = 1..H gets slope 2 ** (-alibi_bias_max * h / H) (H rounded up to 2^k)."""
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    embed_pdrop: float = 0.0
    """Dropout probability on the token embeddings, in [0, 1)."""
    resid_pdrop: float = 0.0
    """Dropout probability on each attention and MLP output before it joins the residual stream, in [0, 1)."""
    attn_pdrop: float = 0.0
    activation_function: str = "gelu"
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
        check_positive(self, "seq_len", "hidden_dim", "num_layers", "num_heads", "expansion_ratio")
        if self.intermediate_dim is not None:
            check_positive(self, "intermediate_dim")
        check_heads_divide(self)
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"MptConfig.clip_qkv must be positive (or null for no clipping), got {self.clip_qkv}")
        if not self.alibi_bias_max > 0:
            raise ValueError(f"MptConfig.alibi_bias_max must be positive, got {self.alibi_bias_max}")
        check_probability(self, "embed_pdrop", "resid_pdrop", "attn_pdrop")
        check_layer_stack(self)
        check_activation(self)

    @property
    def Mlp(self) -> Axis:
        size = self.intermediate_dim if self.intermediate_dim is not None else self.expansion_ratio * self.hidden_dim
        return Axis("mlp", size)

    def attention_options(self) -> AttentionOptions:
        """The attention layer's settings for this config."""
        from .attention import AttentionOptions

        return AttentionOptions(
            Embed=self.Embed,
            Heads=self.Heads,
            KVHeads=self.KVHeads,
            HeadSize=self.HeadSize,
            use_bias=False,
            upcast_softmax=self.upcast_attn,
            dropout_rate=self.attn_pdrop,
            clip_qkv=self.clip_qkv,
            alibi_max_bias=self.alibi_bias_max,
            use_flash_attention=self.use_flash_attention,
            flash_block_size=self.flash_attention_block_size,
            backend=self.attn_backend,
        )

    model_class = "lm_models.mpt:MptLMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token (see lm_models.flops for the formula)."""
        weights = transformer_matmul_weights(
            hidden_dim=self.hidden_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_size=self.HeadSize.size,
            mlp_dim=self.Mlp.size,
            mlp_matrices=2,
            vocab_size=vocab_size,
        )
        attention = attention_flops_per_token(
            num_layers=self.num_layers,
            seq_len=seq_len or self.seq_len,
            num_heads=self.num_heads,
            head_size=self.HeadSize.size,
        )
        return training_flops_per_token(weights, attention)
