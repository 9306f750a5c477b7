"""Qwen3-MoE: Qwen 3's attention (per-head q/k norms) with a sparse mixture of experts as the MLP of every
`decoder_sparse_step`-th layer except `mlp_only_layers`, which keep a dense MLP."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import named_tensors as nt

from .config import LmConfig, check_positive
from .decoder_config import DecoderConfig, DecoderSpec, layer_windows
from .decoder_hf import LLAMA_NORMS, check_layer_types, common_from_hf, common_to_hf, decoder_mapping
from .hf_config import HfConfigReader, refuse
from .hf_layout import HfTensor, split, tensor
from .mixtral import check_router_settings
from .rope import RopeConfig


@LmConfig.register_subclass("qwen3_moe")
@dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig):
    """Qwen3-MoE hyperparameters (defaults: Qwen3-30B-A3B).

    Each sparse layer routes every token to `num_experts_per_tok` of `n_routed_experts` gated experts of
    `moe_intermediate_dim` (softmax over the experts, then the top k, renormalised when `norm_topk_prob`); dense
    layers have a gated MLP of `intermediate_dim`. Layer i (from 0) is sparse when (i + 1) % decoder_sparse_step
    == 0 and i is not in mlp_only_layers. A model that mixes dense and sparse layers runs them unrolled
    (scan_layers: false). The model reports `router_aux_loss` (load balancing, averaged over the sparse layers),
    weighted by lbl_coef, and `router_z_loss` when rzl_coef is set.
    """

    seq_len: int = 40960
    hidden_dim: int = 2048
    intermediate_dim: int = 6144
    num_layers: int = 48
    num_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int | None = 128
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=1e6))
    attention_bias: bool = False
    """Biases on the q, k, v and output projections of attention."""
    sliding_window: int | None = None
    """Each query attends to its last sliding_window positions (itself included), in every layer; null: full
    causal attention (transformers' use_sliding_window)."""
    moe_intermediate_dim: int = 768
    """The hidden width of each expert (the dense layers' MLP has intermediate_dim)."""
    n_routed_experts: int = 128
    """Experts per sparse layer."""
    num_experts_per_tok: int = 8
    """Experts the router picks for each token (top-k), between 1 and n_routed_experts."""
    norm_topk_prob: bool = True
    """Renormalise the k chosen router probabilities to sum to one; false: weight each expert by its probability."""
    decoder_sparse_step: int = 1
    """Every this-many-th layer is sparse (1: all of them), counting from 1."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers (from 0) that keep a dense MLP whatever decoder_sparse_step says."""
    lbl_coef: float | None = 0.001
    """Weight of router_aux_loss (load balancing) in the training loss; null or 0: not added."""
    rzl_coef: float | None = None
    """Weight of router_z_loss in the training loss; null or 0: not computed."""
    moe_block_size: int = nt.DEFAULT_MOE_BLOCK_SIZE
    """Token rows per block of the expert dispatch: a speed knob that does not change the result."""

    def __post_init__(self) -> None:
        check_router_settings(self)
        check_positive(self, "moe_intermediate_dim", "decoder_sparse_step")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # a YAML/JSON list
        bad = [i for i in self.mlp_only_layers if isinstance(i, bool) or not isinstance(i, int)]
        bad += [i for i in self.mlp_only_layers if i not in bad and not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"Qwen3MoeConfig.mlp_only_layers must list layers from 0 to num_layers - 1 = {self.num_layers - 1}, "
                f"got {bad[0]!r}"
            )
        super().__post_init__()

    def dense_layers(self) -> tuple[int, ...]:
        """The layers (from 0) with a dense MLP."""
        return tuple(
            i for i in range(self.num_layers) if i in self.mlp_only_layers or (i + 1) % self.decoder_sparse_step != 0
        )

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks with per-head q/k norms and a mixture of experts in the sparse layers."""
        return DecoderSpec(
            qkv_bias=self.attention_bias,
            out_bias=self.attention_bias,
            qk_norm="head",
            layer_windows=layer_windows(self.num_layers, self.sliding_window, [True] * self.num_layers),
            num_experts=self.n_routed_experts,
            experts_per_token=self.num_experts_per_tok,
            router_z_loss=bool(self.rzl_coef),
            moe_block_size=self.moe_block_size,
            expert_dim=self.moe_intermediate_dim,
            normalize_expert_weights=self.norm_topk_prob,
            dense_layers=self.dense_layers(),
        )

    def aux_loss_weights(self) -> dict[str, float]:
        """lbl_coef for router_aux_loss, rzl_coef for router_z_loss (0 when null)."""
        return {"router_aux_loss": float(self.lbl_coef or 0.0), "router_z_loss": float(self.rzl_coef or 0.0)}


def qwen3_moe_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Qwen3MoeConfig keyword arguments from a Qwen3-MoE config.json.

    transformers has the load-balancing loss (router_aux_loss_coef) and no router z-loss, so an imported model
    trains with lbl_coef = router_aux_loss_coef and rzl_coef null.
    """
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    use_window = bool(r.get("use_sliding_window", False))
    window = r.get("sliding_window", 4096)  # read either way: without use_sliding_window it has no effect
    window = window if use_window else None
    # transformers 5's Qwen3-MoE gives every layer the window when use_sliding_window is set; the key
    # max_window_layers that Qwen's own config.json files carry does not change that.
    r.ignore("max_window_layers")
    check_layer_types(r, [window is not None] * kwargs["num_layers"], "use_sliding_window and sliding_window")
    # output_router_logits only says whether transformers returns the router logits.
    r.ignore("output_router_logits")
    experts = r.get("num_experts", r.get("num_local_experts", 128))
    if r.hf.get("num_local_experts") is not None and r.hf["num_local_experts"] != experts:
        raise r.fail("num_local_experts", f"differs from num_experts={experts}; keep one value")
    kwargs.update(
        attention_bias=bool(r.get("attention_bias", False)),
        sliding_window=window,
        moe_intermediate_dim=r.require("moe_intermediate_size"),
        n_routed_experts=experts,
        num_experts_per_tok=r.get("num_experts_per_tok", 8),
        norm_topk_prob=bool(r.get("norm_topk_prob", False)),
        decoder_sparse_step=r.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(r.get("mlp_only_layers", [])),
        lbl_coef=r.get("router_aux_loss_coef", 0.001),
        rzl_coef=None,
    )
    if experts == 0:
        raise r.fail("num_experts", "a Qwen3-MoE without experts is Qwen3; convert it as model_type qwen3")
    dense = [i for i in range(kwargs["num_layers"]) if i in kwargs["mlp_only_layers"]
             or (i + 1) % kwargs["decoder_sparse_step"] != 0]  # fmt: skip
    if dense and len(dense) < kwargs["num_layers"]:
        kwargs["scan_layers"] = False  # dense and sparse layers cannot share one scan
    r.finish()
    return kwargs


def qwen3_moe_to_hf(config: Qwen3MoeConfig, vocab_size: int) -> dict[str, Any]:
    """A Qwen3-MoE config.json (the family's keys) for our config; the router z-loss has no key there."""
    refuse(
        bool(config.rzl_coef),
        "Qwen3MoeConfig with rzl_coef cannot be exported as is: transformers' Qwen3-MoE has no router z-loss. "
        "Set rzl_coef: null to export (the weights do not depend on it).",
    )
    return {
        **common_to_hf(config, vocab_size),
        "attention_bias": config.attention_bias,
        "use_sliding_window": config.sliding_window is not None,
        "sliding_window": config.sliding_window,
        "moe_intermediate_size": config.moe_intermediate_dim,
        "num_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": config.decoder_sparse_step,
        "mlp_only_layers": list(config.mlp_only_layers),
        "router_aux_loss_coef": config.lbl_coef or 0.0,
    }


def qwen3_moe_experts(h: str, layers: tuple[int, ...] | None) -> list[HfTensor]:
    """Qwen3-MoE's experts in layer prefix `h`: the router mlp.gate and gate_proj/up_proj/down_proj per expert
    (the per-expert layout transformers writes; it fuses gate and up only in memory)."""
    e = h + "mlp.experts.{expert}."
    return [
        tensor(h + "mlp.gate.weight", "mlp.router.weight", "experts", "embed", layers=layers),
        split(e + "gate_proj.weight", "mlp.experts.gate", "experts", "mlp", "embed", layers=layers),
        split(e + "up_proj.weight", "mlp.experts.up", "experts", "mlp", "embed", layers=layers),
        split(e + "down_proj.weight", "mlp.experts.down", "experts", "embed", "mlp", layers=layers),
    ]


Qwen3MoeConfig.hf_mapping = decoder_mapping(
    "qwen3_moe", "Qwen3MoeForCausalLM", qwen3_moe_from_hf, qwen3_moe_to_hf, LLAMA_NORMS, qwen3_moe_experts
)
