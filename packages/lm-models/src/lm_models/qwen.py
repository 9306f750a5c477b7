"""Qwen 2 / 2.5 (biases on q, k and v) and Qwen 3 (per-head RMSNorm on queries and keys, explicit head_dim)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import LmConfig
from .decoder_config import DecoderConfig, DecoderSpec, layer_windows
from .decoder_hf import LLAMA_NORMS, check_layer_types, common_from_hf, common_to_hf, decoder_mapping, layer_types_to_hf
from .hf_config import HfConfigReader
from .rope import RopeConfig


@dataclass(frozen=True)
class _QwenWindows(DecoderConfig):
    """Qwen's optional sliding window: layers max_window_layers and up use it when use_sliding_window."""

    use_sliding_window: bool = False
    """Give the layers from max_window_layers on a sliding window; false: full causal attention everywhere."""
    sliding_window: int | None = 4096
    """With use_sliding_window, each query of a windowed layer sees its last sliding_window positions; null: none."""
    max_window_layers: int = 28
    """The first layer (counting from 0) that gets the sliding window; the layers below attend fully."""

    def windows(self) -> tuple[int | None, ...] | None:
        window = self.sliding_window if self.use_sliding_window else None
        sliding = [i >= self.max_window_layers for i in range(self.num_layers)]
        return layer_windows(self.num_layers, window, sliding)


@LmConfig.register_subclass("qwen2")
@dataclass(frozen=True)
class Qwen2Config(_QwenWindows):
    """Qwen 2 / 2.5 hyperparameters (defaults: Qwen2.5-7B); Levanter's `qwen` keys.

    Biases on the q, k and v projections (none on o_proj or the MLP), as in transformers' Qwen2.
    """

    seq_len: int = 32768
    hidden_dim: int = 3584
    intermediate_dim: int = 18944
    num_layers: int = 28
    num_heads: int = 28
    num_kv_heads: int = 4
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=1e6))

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks with q/k/v biases."""
        return DecoderSpec(qkv_bias=True, layer_windows=self.windows())


@LmConfig.register_subclass("qwen3")
@dataclass(frozen=True)
class Qwen3Config(_QwenWindows):
    """Qwen 3 hyperparameters (defaults: Qwen3-8B).

    RMSNorm over each head's queries and keys before RoPE; `head_dim` is explicit (128 whatever hidden_dim /
    num_heads is); `attention_bias` puts biases on all four attention projections.
    """

    seq_len: int = 40960
    hidden_dim: int = 4096
    intermediate_dim: int = 12288
    num_layers: int = 36
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int | None = 128
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=1e6))
    attention_bias: bool = False
    """Biases on the q, k, v and output projections of attention."""

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks with per-head q/k norms."""
        return DecoderSpec(
            qkv_bias=self.attention_bias, out_bias=self.attention_bias, qk_norm="head", layer_windows=self.windows()
        )


def qwen_windows_from_hf(r: HfConfigReader, num_layers: int) -> dict[str, Any]:
    """use_sliding_window, sliding_window and max_window_layers, checked against layer_types."""
    use = bool(r.get("use_sliding_window", False))
    window = r.get("sliding_window", 4096)
    first = r.get("max_window_layers", 28)
    check_layer_types(
        r, [use and i >= first for i in range(num_layers)], "use_sliding_window, sliding_window and max_window_layers"
    )
    return {"use_sliding_window": use, "sliding_window": window, "max_window_layers": first}


def qwen_windows_to_hf(config: _QwenWindows) -> dict[str, Any]:
    """The window keys of a Qwen config.json, with the layer_types they give."""
    return {
        "use_sliding_window": config.use_sliding_window,
        "sliding_window": config.sliding_window,
        "max_window_layers": config.max_window_layers,
        "layer_types": layer_types_to_hf(config),
    }


def qwen2_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Qwen2Config keyword arguments from a Qwen2 config.json."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    kwargs.update(qwen_windows_from_hf(r, kwargs["num_layers"]))
    if r.get("use_mrope", False):
        raise r.fail("use_mrope", "multimodal RoPE (Qwen2-VL) is not supported")
    # transformers' Qwen2 always has q/k/v biases and none elsewhere, whatever attention_bias says.
    r.ignore("attention_bias")
    r.finish()
    return kwargs


def qwen2_to_hf(config: Qwen2Config, vocab_size: int) -> dict[str, Any]:
    """A Qwen2 config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), **qwen_windows_to_hf(config)}


def qwen3_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Qwen3Config keyword arguments from a Qwen3 config.json."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    kwargs.update(qwen_windows_from_hf(r, kwargs["num_layers"]), attention_bias=bool(r.get("attention_bias", False)))
    r.finish()
    return kwargs


def qwen3_to_hf(config: Qwen3Config, vocab_size: int) -> dict[str, Any]:
    """A Qwen3 config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), **qwen_windows_to_hf(config), "attention_bias": config.attention_bias}


Qwen2Config.hf_mapping = decoder_mapping("qwen2", "Qwen2ForCausalLM", qwen2_from_hf, qwen2_to_hf, LLAMA_NORMS)
Qwen3Config.hf_mapping = decoder_mapping("qwen3", "Qwen3ForCausalLM", qwen3_from_hf, qwen3_to_hf, LLAMA_NORMS)
