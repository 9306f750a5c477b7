"""Mixtral: Mistral with a sparse mixture of gated experts (top-k of E per token) in place of each MLP."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import named_tensors as nt

from .config import LmConfig, check_positive
from .decoder_config import DecoderSpec, layer_windows
from .decoder_hf import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_mapping
from .hf_config import HfConfigReader, refuse
from .mistral import MistralConfig
from .rope import RopeConfig


@LmConfig.register_subclass("mixtral")
@dataclass(frozen=True)
class MixtralConfig(MistralConfig):
    """Mixtral hyperparameters (defaults: Mixtral-8x7B-v0.1); the keys are Levanter's `mixtral` keys.

    Each MLP is a mixture of gated experts of `intermediate_dim` each. The model reports two auxiliary losses
    (LmHeadModel.activations_and_aux), averaged over layers: `router_aux_loss`, the load-balancing loss
    (num_experts * sum_e f_e * P_e, k when balanced), and `router_z_loss` (mean squared logsumexp of the router
    logits).
    """

    seq_len: int = 32768
    layer_norm_epsilon: float = 1e-5
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=1e6))
    n_routed_experts: int = 8
    """Experts per layer."""
    num_experts_per_tok: int = 2
    """Experts the router picks for each token (top-k), between 1 and n_routed_experts."""
    lbl_coef: float | None = 0.01
    """Weight of router_aux_loss (load balancing) in the training loss; null or 0: not added."""
    rzl_coef: float | None = 0.001
    """Weight of router_z_loss in the training loss; null or 0: not computed."""
    moe_block_size: int = nt.DEFAULT_MOE_BLOCK_SIZE
    """Token rows per block of the expert dispatch: a speed knob that does not change the result."""

    def __post_init__(self) -> None:
        check_router_settings(self)
        super().__post_init__()

    def decoder_spec(self) -> DecoderSpec:
        """Mistral's blocks with a mixture of experts as the MLP."""
        return DecoderSpec(
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            layer_windows=layer_windows(self.num_layers, self.sliding_window, [True] * self.num_layers),
            num_experts=self.n_routed_experts,
            experts_per_token=self.num_experts_per_tok,
            router_z_loss=bool(self.rzl_coef),
            moe_block_size=self.moe_block_size,
        )

    def aux_loss_weights(self) -> dict[str, float]:
        """lbl_coef for router_aux_loss, rzl_coef for router_z_loss (0 when null)."""
        return {"router_aux_loss": float(self.lbl_coef or 0.0), "router_z_loss": float(self.rzl_coef or 0.0)}


def mixtral_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
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


def mixtral_to_hf(config: MixtralConfig, vocab_size: int) -> dict[str, Any]:
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


def check_router_settings(config: Any) -> None:
    """Raise unless the expert counts and block size are positive and lbl_coef/rzl_coef are >= 0 or null."""
    check_positive(config, "n_routed_experts", "num_experts_per_tok", "moe_block_size")
    for name in ("lbl_coef", "rzl_coef"):
        value = getattr(config, name)
        if value is not None and not value >= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be >= 0 (or null to turn it off), got {value!r}")


MixtralConfig.hf_mapping = decoder_mapping("mixtral", "MixtralForCausalLM", mixtral_from_hf, mixtral_to_hf, LLAMA_NORMS)
