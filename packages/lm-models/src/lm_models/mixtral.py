"""Mixtral: Mistral with a sparse mixture of gated experts (top-k of E per token) in place of each MLP."""

from __future__ import annotations

from dataclasses import dataclass, field

import named_tensors as nt

from .config import LmConfig, check_positive
from .decoder_config import DecoderSpec, layer_windows
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
        check_positive(self, "n_routed_experts", "num_experts_per_tok", "moe_block_size")
        for name in ("lbl_coef", "rzl_coef"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"MixtralConfig.{name} must be >= 0 (or null to turn it off), got {value!r}")
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
