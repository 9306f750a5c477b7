"""Gemma 2: config.json <-> Gemma2Config (sandwich norms, soft-capping, local/global layers), and the layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import Gemma2Config

from .decoder import SANDWICH_NORMS, SLIDING, common_to_hf, decoder_family, layer_types_to_hf
from .gemma import gemma_common
from .hf_keys import HfConfigReader


def sliding_window_pattern(r: HfConfigReader, num_layers: int, default: int) -> int:
    """Every how many layers one is global: from sliding_window_pattern, or found from layer_types."""
    given = r.get("sliding_window_pattern", r.get("_sliding_window_pattern"))
    types = r.get("layer_types")
    if types is None:
        return int(given or default)
    candidates = [int(given)] if given else range(1, num_layers + 2)
    for pattern in candidates:
        if list(types) == [SLIDING if (i + 1) % pattern else "full_attention" for i in range(num_layers)]:
            return pattern
    raise r.fail(
        "layer_types",
        "is not every-n-th-layer-global (lm_models' Gemma layer pattern"
        + (f", with sliding_window_pattern={given})" if given else ")")
        + "; converting would change the model",
    )


def local_global_from_hf(r: HfConfigReader, default_pattern: int, *, rope: bool = True) -> dict[str, Any]:
    """The keys Gemma 2 and 3 add to Gemma's (`rope`: read the rope keys too)."""
    kwargs = gemma_common(r, "hidden_activation", "hidden_act", rope=rope)
    # cache_implementation only picks transformers' KV-cache class for generation.
    r.ignore("cache_implementation")
    kwargs.update(
        query_pre_attn_scalar=r.get("query_pre_attn_scalar", 256),
        sliding_window=r.get("sliding_window"),
        sliding_window_pattern=sliding_window_pattern(r, kwargs["num_layers"], default_pattern),
        attn_logit_softcapping=r.get("attn_logit_softcapping"),
        final_logit_softcapping=r.get("final_logit_softcapping"),
    )
    return kwargs


def local_global_to_hf(config: Any, vocab_size: int) -> dict[str, Any]:
    """The Gemma 2/3 keys of a config.json for our config."""
    return {
        **common_to_hf(config, vocab_size, activation_key="hidden_activation"),
        "attention_bias": config.use_bias,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "sliding_window": config.sliding_window,
        "layer_types": layer_types_to_hf(config),
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
    }


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gemma2Config keyword arguments from a Gemma 2 config.json (without layer_types: alternating, local first)."""
    r = HfConfigReader(hf, where)
    kwargs = local_global_from_hf(r, 2)
    r.finish()
    return kwargs


def config_to_hf(config: Gemma2Config, vocab_size: int) -> dict[str, Any]:
    """A Gemma 2 config.json (the family's keys) for our config."""
    return local_global_to_hf(config, vocab_size)


GEMMA2 = decoder_family("gemma2", "gemma2", "Gemma2ForCausalLM", config_from_hf, config_to_hf, SANDWICH_NORMS)
