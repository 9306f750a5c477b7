"""Mistral: Llama's decoder with grouped-query attention and a sliding attention window."""

from __future__ import annotations

from dataclasses import dataclass

from .config import LmConfig
from .decoder_config import DecoderConfig, DecoderSpec, layer_windows


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
