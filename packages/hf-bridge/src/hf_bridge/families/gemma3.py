"""Gemma 3 (text): config.json <-> Gemma3Config (q/k norms, a local RoPE theta), and the checkpoint layout.

The text-only `gemma3_text` model (Gemma3ForCausalLM); the multimodal `gemma3` checkpoints are not converted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import Gemma3Config

from ..errors import HfBridgeError
from .decoder import FULL, SANDWICH_NORMS, SLIDING, decoder_family, refuse
from .gemma2 import local_global_from_hf, local_global_to_hf
from .hf_keys import HfConfigReader
from .rope import rope_from_hf, rope_section


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gemma3Config keyword arguments from a gemma3_text config.json (transformers 4's or 5's rope keys)."""
    r = HfConfigReader(hf, where)
    section, params = rope_section(r)
    if set(params) & {SLIDING, FULL}:  # transformers 5: one rope dict per layer type
        unknown = sorted(set(params) - {SLIDING, FULL})
        if unknown:
            raise HfBridgeError(f"{where}: {section} has layer types {unknown} that Gemma 3 does not have.")
        glob = rope_from_hf(r, params.get(FULL) or {}, f"{section}.{FULL}")
        local = rope_from_hf(r, params.get(SLIDING) or {"rope_theta": 10000.0}, f"{section}.{SLIDING}")
    else:
        glob = rope_from_hf(r, {**params, "rope_theta": r.get("rope_theta", 1e6)}, section)
        local = rope_from_hf(r, {"rope_theta": r.get("rope_local_base_freq", 10000.0)}, "rope_local_base_freq")
    if local.type != "default":
        raise HfBridgeError(
            f"{where}: the sliding layers' RoPE has type {local.type!r}; lm_models' Gemma 3 gives its local layers "
            "plain RoPE, and converting would change the model."
        )
    kwargs = local_global_from_hf(r, 6, rope=False)
    kwargs.update(rope=glob, rope_local_base_freq=local.theta)
    r.finish()
    return kwargs


def config_to_hf(config: Gemma3Config, vocab_size: int) -> dict[str, Any]:
    """A gemma3_text config.json (the family's keys, in transformers 4's form, which 5 also reads)."""
    refuse(
        config.rope.type == "dynamic",
        "Gemma3Config with dynamic rope cannot be exported: transformers' max_position_embeddings would move.",
    )
    return {
        **local_global_to_hf(config, vocab_size),
        "rope_local_base_freq": config.rope_local_base_freq,
        "sliding_window_pattern": config.sliding_window_pattern,
    }


GEMMA3 = decoder_family("gemma3_text", "gemma3", "Gemma3ForCausalLM", config_from_hf, config_to_hf, SANDWICH_NORMS)
