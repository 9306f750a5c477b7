"""OLMo 2: norms after attention and after the MLP (none before them), and RMSNorm on all queries and keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import LmConfig
from .decoder_config import DecoderConfig, DecoderSpec
from .decoder_hf import common_from_hf, common_to_hf, decoder_mapping
from .hf_config import HfConfigReader
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


# Where OLMo 2's two norms (after attention, after the MLP) live in its checkpoint.
OLMO2_NORMS = {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def olmo2_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Olmo2Config keyword arguments from an OLMo 2 config.json."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    kwargs["attention_bias"] = bool(r.get("attention_bias", False))
    r.finish()
    return kwargs


def olmo2_to_hf(config: Olmo2Config, vocab_size: int) -> dict[str, Any]:
    """An OLMo 2 config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), "attention_bias": config.attention_bias}


Olmo2Config.hf_mapping = decoder_mapping("olmo2", "Olmo2ForCausalLM", olmo2_from_hf, olmo2_to_hf, OLMO2_NORMS)
