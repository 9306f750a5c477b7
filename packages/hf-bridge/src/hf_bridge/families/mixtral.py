"""Mixtral: config.json <-> MixtralConfig, and the checkpoint layout (one tensor per expert and matrix)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import MixtralConfig

from .decoder import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_family, refuse
from .hf_keys import HfConfigReader


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """MixtralConfig keyword arguments from a Mixtral config.json.

    transformers' Mixtral has the load-balancing loss (router_aux_loss_coef) and no router z-loss, so an imported
    model trains with lbl_coef = router_aux_loss_coef and rzl_coef null (override them to change that).
    """
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    jitter = r.get("router_jitter_noise", 0.0)
    if jitter:
        raise r.fail("router_jitter_noise", "lm_models' Mixtral does not jitter its router inputs; use 0")
    # output_router_logits only says whether transformers returns the router logits.
    r.ignore("output_router_logits")
    kwargs.update(
        sliding_window=r.get("sliding_window"),
        n_routed_experts=r.get("num_local_experts", 8),
        num_experts_per_tok=r.get("num_experts_per_tok", 2),
        lbl_coef=r.get("router_aux_loss_coef", 0.001),
        rzl_coef=None,
    )
    r.finish()
    return kwargs


def config_to_hf(config: MixtralConfig, vocab_size: int) -> dict[str, Any]:
    """A Mixtral config.json (the family's keys) for our config; the router z-loss has no key there."""
    refuse(config.use_bias, "MixtralConfig(use_bias=True) cannot be exported: transformers' Mixtral has no biases.")
    return {
        **common_to_hf(config, vocab_size),
        "sliding_window": config.sliding_window,
        "num_local_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "router_aux_loss_coef": config.lbl_coef or 0.0,
        "router_jitter_noise": 0.0,
    }


MIXTRAL = decoder_family("mixtral", "mixtral", "MixtralForCausalLM", config_from_hf, config_to_hf, LLAMA_NORMS)
