"""gpt-oss: attention with a learned sink logit per head, sliding and full layers alternating, YaRN RoPE, and a
mixture of experts with biases and a clamped SwiGLU in every layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import named_tensors as nt

from .config import LmConfig
from .decoder_config import DecoderConfig, DecoderSpec, layer_windows
from .decoder_hf import LLAMA_NORMS, check_layer_types, common_from_hf, common_to_hf, decoder_mapping
from .hf_config import HfConfigReader, refuse
from .hf_layout import HfTensor, fused, tensor
from .mixtral import check_router_settings
from .rope import RopeConfig


@LmConfig.register_subclass("gpt_oss")
@dataclass(frozen=True)
class GptOssConfig(DecoderConfig):
    """gpt-oss hyperparameters (defaults: gpt-oss-20b).

    Every attention softmax has one more logit per head, a learned sink that takes a share of the weight; layers
    0, 2, 4, ... attend within `sliding_window`, the others fully; q/k/v/o have biases. Every MLP is a mixture of
    `n_routed_experts` experts of `intermediate_dim` (a router with a bias; softmax over the k largest logits),
    each with biases and the clamped SwiGLU (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    limit). The sinks exist only in our plain attention kernel: attn_backend default or vanilla.
    """

    seq_len: int = 131072
    hidden_dim: int = 2880
    intermediate_dim: int = 2880
    num_layers: int = 24
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int | None = 64
    layer_norm_epsilon: float = 1e-5
    rope: RopeConfig = field(
        default_factory=lambda: RopeConfig(
            type="yarn", theta=150000.0, factor=32.0, original_max_position_embeddings=4096, truncate=False
        )
    )
    attention_bias: bool = True
    """Biases on the q, k, v and output projections of attention."""
    sliding_window: int | None = 128
    """Positions each query of a sliding layer (0, 2, 4, ...) sees, itself included; null: every layer attends fully."""
    n_routed_experts: int = 32
    """Experts per layer."""
    num_experts_per_tok: int = 4
    """Experts the router picks for each token (top-k), between 1 and n_routed_experts."""
    swiglu_limit: float = 7.0
    """The clamp of the experts' SwiGLU: gate <= limit, -limit <= up <= limit."""
    swiglu_alpha: float = 1.702
    """The experts' gate is g * sigmoid(swiglu_alpha * g)."""
    lbl_coef: float | None = 0.001
    """Weight of router_aux_loss (load balancing) in the training loss; null or 0: not added."""
    rzl_coef: float | None = None
    """Weight of router_z_loss in the training loss; null or 0: not computed."""
    moe_block_size: int = nt.DEFAULT_MOE_BLOCK_SIZE
    """Token rows per block of the expert dispatch: a speed knob that does not change the result."""

    def __post_init__(self) -> None:
        check_router_settings(self)
        if not self.swiglu_limit > 0:
            raise ValueError(f"GptOssConfig.swiglu_limit must be positive, got {self.swiglu_limit!r}")
        if self.use_flash_attention or self.attn_backend not in ("default", "vanilla"):
            raise ValueError(
                "GptOssConfig: attention sinks are computed by our plain attention kernel only; set attn_backend: "
                "default (or vanilla) and use_flash_attention: false"
            )
        super().__post_init__()

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) uses the sliding window: layers 0, 2, 4, ..."""
        return layer % 2 == 0

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks with sinks, alternating windows and a mixture of biased, clamped experts."""
        return DecoderSpec(
            qkv_bias=self.attention_bias,
            out_bias=self.attention_bias,
            layer_windows=layer_windows(
                self.num_layers, self.sliding_window, [self.is_sliding(i) for i in range(self.num_layers)]
            ),
            num_experts=self.n_routed_experts,
            experts_per_token=self.num_experts_per_tok,
            router_z_loss=bool(self.rzl_coef),
            moe_block_size=self.moe_block_size,
            router_bias=True,
            expert_bias=True,
            swiglu_limit=float(self.swiglu_limit),
            swiglu_alpha=float(self.swiglu_alpha),
            attention_sinks=True,
        )

    def aux_loss_weights(self) -> dict[str, float]:
        """lbl_coef for router_aux_loss, rzl_coef for router_z_loss (0 when null)."""
        return {"router_aux_loss": float(self.lbl_coef or 0.0), "router_z_loss": float(self.rzl_coef or 0.0)}


def gpt_oss_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """GptOssConfig keyword arguments from a gpt-oss config.json (layer_types must alternate, sliding first)."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    # hidden_act names no function here: the experts' clamped SwiGLU is fixed by swiglu_alpha and swiglu_limit.
    kwargs.pop("activation_function")
    # output_router_logits only says whether transformers returns the router logits.
    r.ignore("output_router_logits")
    window = r.get("sliding_window", 128)
    check_layer_types(r, [i % 2 == 0 for i in range(kwargs["num_layers"])], "gpt-oss's alternation (sliding first)")
    kwargs.update(
        attention_bias=bool(r.get("attention_bias", True)),
        sliding_window=window,
        n_routed_experts=r.get("num_local_experts", 128),
        num_experts_per_tok=r.get("num_experts_per_tok", 4),
        swiglu_limit=r.get("swiglu_limit", 7.0),
        swiglu_alpha=r.get("swiglu_alpha", 1.702),
        lbl_coef=r.get("router_aux_loss_coef", 0.001),
        rzl_coef=None,
    )
    r.finish()
    return kwargs


def gpt_oss_to_hf(config: GptOssConfig, vocab_size: int) -> dict[str, Any]:
    """A gpt-oss config.json (the family's keys) for our config; the router z-loss has no key there."""
    refuse(
        bool(config.rzl_coef),
        "GptOssConfig with rzl_coef cannot be exported as is: transformers' gpt-oss has no router z-loss. Set "
        "rzl_coef: null to export (the weights do not depend on it).",
    )
    return {
        **common_to_hf(config, vocab_size),
        "attention_bias": config.attention_bias,
        "sliding_window": config.sliding_window,
        "layer_types": ["sliding_attention" if config.is_sliding(i) else "full_attention"
                        for i in range(config.num_layers)],
        "num_local_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "swiglu_limit": config.swiglu_limit,
        "swiglu_alpha": config.swiglu_alpha,
        "router_aux_loss_coef": config.lbl_coef or 0.0,
    }  # fmt: skip


def gpt_oss_experts(h: str, layers: tuple[int, ...] | None) -> list[HfTensor]:
    """gpt-oss's experts in layer prefix `h` as transformers stores them: the router with its bias, and every
    expert's weights in one tensor each, laid out (experts, in, out), gate and up interleaved in gate_up_proj."""
    m = h + "mlp."
    both = ("experts", "embed", "mlp")
    return [
        tensor(m + "router.weight", "mlp.router.weight", "experts", "embed", layers=layers),
        tensor(m + "router.bias", "mlp.router.bias", "experts", layers=layers),
        fused(m + "experts.gate_up_proj", 2, ("mlp.experts.gate", both), ("mlp.experts.up", both), interleave=True),
        fused(
            m + "experts.gate_up_proj_bias",
            1,
            ("mlp.experts.gate_bias", ("experts", "mlp")),
            ("mlp.experts.up_bias", ("experts", "mlp")),
            interleave=True,
        ),
        tensor(m + "experts.down_proj", "mlp.experts.down", "experts", "mlp", "embed", layers=layers),
        tensor(m + "experts.down_proj_bias", "mlp.experts.down_bias", "experts", "embed", layers=layers),
    ]


GptOssConfig.hf_mapping = decoder_mapping(
    "gpt_oss", "GptOssForCausalLM", gpt_oss_from_hf, gpt_oss_to_hf, LLAMA_NORMS, gpt_oss_experts
)
