"""Qwen 2 / 2.5: config.json <-> Qwen2Config (q/k/v biases, windows on the upper layers), and the layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import Qwen2Config

from .decoder import LLAMA_NORMS, check_layer_types, common_from_hf, common_to_hf, decoder_family, layer_types_to_hf
from .hf_keys import HfConfigReader


def qwen_windows_from_hf(r: HfConfigReader, num_layers: int) -> dict[str, Any]:
    """use_sliding_window, sliding_window and max_window_layers, checked against layer_types."""
    use = bool(r.get("use_sliding_window", False))
    window = r.get("sliding_window", 4096)
    first = r.get("max_window_layers", 28)
    check_layer_types(
        r, [use and i >= first for i in range(num_layers)], "use_sliding_window, sliding_window and max_window_layers"
    )
    return {"use_sliding_window": use, "sliding_window": window, "max_window_layers": first}


def qwen_windows_to_hf(config: Any) -> dict[str, Any]:
    """The window keys of a Qwen config.json, with the layer_types they give."""
    return {
        "use_sliding_window": config.use_sliding_window,
        "sliding_window": config.sliding_window,
        "max_window_layers": config.max_window_layers,
        "layer_types": layer_types_to_hf(config),
    }


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
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


def config_to_hf(config: Qwen2Config, vocab_size: int) -> dict[str, Any]:
    """A Qwen2 config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), **qwen_windows_to_hf(config)}


QWEN2 = decoder_family("qwen2", "qwen2", "Qwen2ForCausalLM", config_from_hf, config_to_hf, LLAMA_NORMS)
