"""OLMo 2: config.json <-> Olmo2Config (post-norms, whole-projection q/k norms), and the checkpoint layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import Olmo2Config

from .decoder import common_from_hf, common_to_hf, decoder_family
from .hf_keys import HfConfigReader

OLMO2_NORMS = {"post_attn_norm": "post_attention_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Olmo2Config keyword arguments from an OLMo 2 config.json."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    kwargs["attention_bias"] = bool(r.get("attention_bias", False))
    r.finish()
    return kwargs


def config_to_hf(config: Olmo2Config, vocab_size: int) -> dict[str, Any]:
    """An OLMo 2 config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), "attention_bias": config.attention_bias}


OLMO2 = decoder_family("olmo2", "olmo2", "Olmo2ForCausalLM", config_from_hf, config_to_hf, OLMO2_NORMS)
