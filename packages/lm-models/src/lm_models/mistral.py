"""Mistral: Llama's decoder with grouped-query attention and a sliding attention window."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import LmConfig
from .decoder_config import DecoderConfig, DecoderSpec, layer_windows
from .decoder_hf import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_mapping
from .hf_config import HfConfigReader, refuse


@LmConfig.register_subclass("mistral")
@dataclass(frozen=True)
class MistralConfig(DecoderConfig):
    """Mistral hyperparameters (defaults: Mistral-7B-v0.1); the keys are Levanter's `mistral` keys.

    `head_dim` may differ from hidden_dim / num_heads (Mistral-Nemo).
    """

    seq_len: int = 8192
    hidden_dim: int = 4096
    intermediate_dim: int = 14336
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    layer_norm_epsilon: float = 1e-6
    sliding_window: int | None = 4096
    """Each query attends to its last sliding_window positions (itself included), in every layer; null: full
    causal attention."""
    use_bias: bool = False
    """Biases on every projection (transformers' Mistral has none, so such a model cannot be exported)."""

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks, a sliding window in every layer."""
        return DecoderSpec(
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            mlp_bias=self.use_bias,
            layer_windows=layer_windows(self.num_layers, self.sliding_window, [True] * self.num_layers),
        )


def mistral_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """MistralConfig keyword arguments from a Mistral config.json."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    kwargs["sliding_window"] = r.get("sliding_window")
    r.finish()
    return kwargs


def mistral_to_hf(config: MistralConfig, vocab_size: int) -> dict[str, Any]:
    """A Mistral config.json (the family's keys) for our config."""
    refuse(config.use_bias, "MistralConfig(use_bias=True) cannot be exported: transformers' Mistral has no biases.")
    return {**common_to_hf(config, vocab_size), "sliding_window": config.sliding_window}


MistralConfig.hf_mapping = decoder_mapping("mistral", "MistralForCausalLM", mistral_from_hf, mistral_to_hf, LLAMA_NORMS)
