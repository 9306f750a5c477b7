"""OLMo 2: norms after attention and after the MLP (none before them), and RMSNorm on all queries and keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import LmConfig
from .decoder_config import DecoderConfig, DecoderSpec
from .rope import RopeConfig


@LmConfig.register_subclass("olmo2")
@dataclass(frozen=True)
class Olmo2Config(DecoderConfig):
    """OLMo 2 hyperparameters (defaults: OLMo-2-1124-7B).

    Each block is x + norm(attn(x)), then x + norm(mlp(x)); queries and keys are RMS-normalised over all heads
    at once (one norm of heads * head_size features), before RoPE.
    """

    seq_len: int = 4096
    hidden_dim: int = 4096
    intermediate_dim: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=500000.0))
    attention_bias: bool = False
    """Biases on the q, k, v and output projections of attention."""

    def decoder_spec(self) -> DecoderSpec:
        """Post-norm blocks with whole-projection q/k norms."""
        return DecoderSpec(
            pre_attn_norm=False,
            post_attn_norm=True,
            pre_mlp_norm=False,
            post_mlp_norm=True,
            qkv_bias=self.attention_bias,
            out_bias=self.attention_bias,
            qk_norm="all",
        )
