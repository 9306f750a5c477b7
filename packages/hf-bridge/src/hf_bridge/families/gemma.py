"""Gemma (1): config.json <-> GemmaConfig (GeGLU, sqrt(hidden) embedding scale, (1 + w) norms), and the layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import GemmaConfig

from .decoder import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_family, expect_falsy
from .hf_keys import HfConfigReader


def gemma_activation(r: HfConfigReader, key: str, other: str) -> str:
    """The activation transformers uses (`key`; a legacy "gelu" means the tanh GELU), checked against `other`,
    the key the other Gemma generation reads, which must agree when set."""
    activation = r.get(key, "gelu_pytorch_tanh")
    if activation == "gelu":  # transformers rewrites Gemma's legacy "gelu" to the tanh approximation
        activation = "gelu_pytorch_tanh"
    alias = r.get(other)
    if alias is not None and alias != activation and not (alias == "gelu" and activation == "gelu_pytorch_tanh"):
        raise r.fail(other, f"differs from {key}={activation!r}; transformers versions disagree on which to use")
    return activation


def gemma_common(r: HfConfigReader, key: str, other: str, *, rope: bool = True) -> dict[str, Any]:
    """The keys Gemma 1, 2 and 3 share (`rope`: read the rope keys too)."""
    activation = gemma_activation(r, key, other)
    kwargs = common_from_hf(r, activation_key=key, rope=rope)
    kwargs["activation_function"] = activation
    kwargs["tie_word_embeddings"] = r.get("tie_word_embeddings", True)
    kwargs["use_bias"] = bool(r.get("attention_bias", False))
    expect_falsy(r, "use_bidirectional_attention", "lm_models' Gemma is a causal LM")
    return kwargs


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """GemmaConfig keyword arguments from a Gemma config.json."""
    r = HfConfigReader(hf, where)
    kwargs = gemma_common(r, "hidden_act", "hidden_activation")
    r.finish()
    return kwargs


def config_to_hf(config: GemmaConfig, vocab_size: int) -> dict[str, Any]:
    """A Gemma config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), "attention_bias": config.use_bias}


GEMMA = decoder_family("gemma", "gemma", "GemmaForCausalLM", config_from_hf, config_to_hf, LLAMA_NORMS)
