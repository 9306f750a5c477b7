"""GPT-2's config (and the GPT-2-style keys Backpack shares), without jax: the model is in lm_models.gpt2."""

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


@dataclass(frozen=True)
class Gpt2StyleConfig(LmConfig):
    """The GPT-2 keys (Levanter's), shared by GPT-2 and Backpack; not a model type of its own."""

    seq_len: int = 512
    hidden_dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    mlp_scale: int = 4
    """The MLP's hidden width as a multiple of hidden_dim."""
    initializer_range: float = 0.02
    embed_pdrop: float = 0.0
    """Dropout probability on the token + position embeddings, in [0, 1)."""
    resid_pdrop: float = 0.0
    """Dropout probability on each attention and MLP output before it joins the residual stream, in [0, 1)."""
    attn_pdrop: float = 0.0
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    scale_attn_by_inverse_layer_idx: bool = False
    """Divide layer i's attention scores by i + 1 (counting from 0), as GPT-2's option of that name."""
    upcast_attn: bool = False
    use_bias: bool = True
    """Biases in the attention and MLP projections and the LayerNorms."""
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
        check_positive(self, "seq_len", "hidden_dim", "num_layers", "num_heads", "mlp_scale")
        check_heads_divide(self)
        check_probability(self, "embed_pdrop", "resid_pdrop", "attn_pdrop")
        check_layer_stack(self)
        check_activation(self)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.hidden_dim * self.mlp_scale)

    @property
    def max_positions(self) -> int:
        """GPT-2 learns one position embedding per slot, so sequences are at most seq_len long."""
        return self.seq_len

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
            use_flash_attention=self.use_flash_attention,
            flash_block_size=self.flash_attention_block_size,
            backend=self.attn_backend,
        )

    def transformer_flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token of the GPT-2 transformer and its tied head (see lm_models.flops)."""
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


@LmConfig.register_subclass("gpt2")
@dataclass(frozen=True)
class Gpt2Config(Gpt2StyleConfig):
    """GPT-2 hyperparameters; the keys are Levanter's `gpt2` model keys."""

    model_class = "lm_models.gpt2:Gpt2LMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token (see lm_models.flops for the formula)."""
        return self.transformer_flops_per_token(vocab_size, seq_len)
