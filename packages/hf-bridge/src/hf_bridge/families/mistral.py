"""Mistral: config.json <-> MistralConfig (sliding window, GQA, explicit head_dim), and the checkpoint layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import MistralConfig

from .decoder import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_family, refuse
from .hf_keys import HfConfigReader


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """MistralConfig keyword arguments from a Mistral config.json."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    kwargs["sliding_window"] = r.get("sliding_window")
    r.finish()
    return kwargs


def config_to_hf(config: MistralConfig, vocab_size: int) -> dict[str, Any]:
    """A Mistral config.json (the family's keys) for our config."""
    refuse(config.use_bias, "MistralConfig(use_bias=True) cannot be exported: transformers' Mistral has no biases.")
    return {**common_to_hf(config, vocab_size), "sliding_window": config.sliding_window}


MISTRAL = decoder_family("mistral", "mistral", "MistralForCausalLM", config_from_hf, config_to_hf, LLAMA_NORMS)
