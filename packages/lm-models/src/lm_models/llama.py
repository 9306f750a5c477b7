"""Llama 1/2/3 as a decoder spec: pre-norm blocks with RMSNorm, a SwiGLU MLP, RoPE (linear, dynamic, yarn or
llama3 scaling) and grouped-query attention; its config and its Hugging Face mapping (the model is
lm_models.decoder's DecoderLMHeadModel)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .config import LmConfig, check_heads_divide
from .decoder_config import DecoderConfig, DecoderSpec
from .decoder_hf import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_mapping
from .hf_config import HfConfigReader, refuse


@LmConfig.register_subclass("llama")
@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Llama hyperparameters; the keys are Levanter's `llama` model keys.

    The head size is hidden_dim / num_heads: `head_dim` may only repeat it.
    """

    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    """Biases on the attention and MLP projections."""
    use_layer_norm_weight: bool = True
    """A learned scale in every RMSNorm; false: normalise only."""

    checkpoint_renames: ClassVar[Mapping[str, str]] = {
        "input_layernorm": "pre_attn_norm",
        "post_attention_layernorm": "pre_mlp_norm",
    }
    """Parameter names of lm-models < 0.8 (Llama's own block) -> the decoder's, so older checkpoints still load."""

    def __post_init__(self) -> None:
        check_heads_divide(self)
        if self.head_dim is not None and self.head_dim * self.num_heads != self.hidden_dim:
            raise ValueError(
                f"LlamaConfig: head_dim={self.head_dim} is not hidden_dim / num_heads = "
                f"{self.hidden_dim}/{self.num_heads}; Llama derives the head size from those two, so leave head_dim "
                "null (or use type mistral for another head size)"
            )
        super().__post_init__()

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks; biases on every projection or on none; norms with or without a learned scale."""
        return DecoderSpec(
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            mlp_bias=self.use_bias,
            norm_weight=self.use_layer_norm_weight,
        )


def llama_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """LlamaConfig keyword arguments from a Llama config.json."""
    r = HfConfigReader(hf, where)
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    if r.get("head_dim", hidden // heads) * heads != hidden:
        raise r.fail("head_dim", f"is not hidden_size / num_attention_heads = {hidden}/{heads}; lm_models' Llama "
                     "derives the head size from those two")  # fmt: skip
    attention_bias = r.get("attention_bias", False)
    mlp_bias = r.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise r.fail("mlp_bias", f"differs from attention_bias={attention_bias}; LlamaConfig.use_bias sets both")
    kwargs = common_from_hf(r)
    kwargs["use_bias"] = attention_bias
    r.finish()
    return kwargs


def llama_to_hf(config: LlamaConfig, vocab_size: int) -> dict[str, Any]:
    """A Llama config.json (the family's keys) for our config."""
    refuse(
        not config.use_layer_norm_weight,
        "LlamaConfig(use_layer_norm_weight=False) cannot be exported: transformers' Llama norms always have a "
        "weight. Train with use_layer_norm_weight=true to export to Hugging Face.",
    )
    return {**common_to_hf(config, vocab_size), "attention_bias": config.use_bias, "mlp_bias": config.use_bias}


LlamaConfig.hf_mapping = decoder_mapping("llama", "LlamaForCausalLM", llama_from_hf, llama_to_hf, LLAMA_NORMS)
