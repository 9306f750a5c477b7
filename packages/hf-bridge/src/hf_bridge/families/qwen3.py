"""Qwen 3: config.json <-> Qwen3Config (per-head q/k norms, explicit head_dim), and the checkpoint layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import Qwen3Config

from .decoder import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_family
from .hf_keys import HfConfigReader
from .qwen2 import qwen_windows_from_hf, qwen_windows_to_hf


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Qwen3Config keyword arguments from a Qwen3 config.json."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    kwargs.update(qwen_windows_from_hf(r, kwargs["num_layers"]), attention_bias=bool(r.get("attention_bias", False)))
    r.finish()
    return kwargs


def config_to_hf(config: Qwen3Config, vocab_size: int) -> dict[str, Any]:
    """A Qwen3 config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), **qwen_windows_to_hf(config), "attention_bias": config.attention_bias}


QWEN3 = decoder_family("qwen3", "qwen3", "Qwen3ForCausalLM", config_from_hf, config_to_hf, LLAMA_NORMS)
