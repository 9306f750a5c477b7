"""Llama 4 (text): mixture-of-experts layers with a shared expert interleaved with dense ones, chunked local
attention with RoPE on interleaved pairs and an L2 qk-norm, and global NoPE layers with temperature tuning."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import named_tensors as nt

from .config import LmConfig, check_positive
from .decoder_config import DecoderConfig, DecoderSpec
from .decoder_hf import LLAMA_NORMS, common_from_hf, common_to_hf, decoder_mapping
from .flops import attention_flops_per_token, training_flops_per_token
from .hf_config import HfConfigReader
from .hf_layout import HfTensor, HfWrapper, fused, tensor
from .rope import RopeConfig

CHUNKED, FULL = "chunked_attention", "full_attention"


@LmConfig.register_subclass("llama4")
@dataclass(frozen=True)
class Llama4Config(DecoderConfig):
    """Llama 4 text hyperparameters (defaults: Llama 4 Scout, 17B active of 16 experts).

    Layer i (from 0) is a mixture of experts when it is in `moe_layers` (null: every interleave_moe_layer_step-th
    layer, counting from 1), else a dense gated MLP of intermediate_dim. A mixture routes each token to the
    num_experts_per_tok experts with the largest router logits, feeds each of them the token times the sigmoid of
    its logit, and adds a shared expert; every expert and the shared one have moe_intermediate_dim units. Layers in
    `nope_layers` (null: every no_rope_layer_interval-th) use no RoPE, attend to every earlier position, and scale
    their queries by 1 + attn_scale * log1p(floor((position + 1) / floor_scale)) when attn_temperature_tuning; the
    others rotate interleaved pairs of features, attend within their chunk of attention_chunk_size positions, and
    L2-normalise queries and keys after RoPE when use_qk_norm. Dense and sparse layers mixed run unrolled
    (scan_layers: false). Chunked attention runs in our plain kernel: attn_backend default (or vanilla).
    """

    seq_len: int = 131072
    hidden_dim: int = 5120
    intermediate_dim: int = 16384
    """The hidden width of the dense layers' MLP (transformers' intermediate_size_mlp)."""
    num_layers: int = 48
    num_heads: int = 40
    num_kv_heads: int = 8
    head_dim: int | None = 128
    layer_norm_epsilon: float = 1e-5
    rope: RopeConfig = field(
        default_factory=lambda: RopeConfig(
            type="llama3", theta=500000.0, factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
            original_max_position_embeddings=8192,
        )
    )  # fmt: skip
    attention_bias: bool = False
    """Biases on the q, k, v and output projections of attention."""
    moe_intermediate_dim: int = 8192
    """The hidden width of each expert and of the shared expert (transformers' intermediate_size)."""
    n_routed_experts: int = 16
    """Experts per sparse layer."""
    num_experts_per_tok: int = 1
    """Experts the router picks for each token (top-k), between 1 and n_routed_experts."""
    interleave_moe_layer_step: int = 1
    """Every this-many-th layer is sparse (1: all of them), counting from 1; moe_layers overrides it."""
    moe_layers: tuple[int, ...] | None = None
    """The sparse layers (from 0); null: from interleave_moe_layer_step."""
    no_rope_layer_interval: int = 4
    """Every this-many-th layer (counting from 1) is a NoPE layer; nope_layers overrides it."""
    nope_layers: tuple[int, ...] | None = None
    """The layers (from 0) without RoPE; null: from no_rope_layer_interval."""
    attention_chunk_size: int | None = 8192
    """RoPE layers attend within chunks of this many positions (position // size equal); null: fully causal."""
    use_qk_norm: bool = True
    """RoPE layers RMS-normalise queries and keys per head, without a weight, after RoPE."""
    attn_temperature_tuning: bool = True
    """NoPE layers scale their queries up with the position (floor_scale, attn_scale)."""
    floor_scale: int = 8192
    """Temperature tuning: positions per step of the log1p (larger: later and slower growth)."""
    attn_scale: float = 0.1
    """Temperature tuning: the strength of the growth."""
    lbl_coef: float | None = 0.001
    """Weight of router_aux_loss (the Switch load-balancing loss over the softmax of the router logits) in the
    training loss; null or 0: not added. transformers' Llama4ForCausalLM adds none."""
    moe_block_size: int = nt.DEFAULT_MOE_BLOCK_SIZE
    """Token rows per block of the expert dispatch: a speed knob that does not change the result."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_positive(self, "n_routed_experts", "num_experts_per_tok", "moe_block_size", "moe_intermediate_dim")
        check_positive(self, "interleave_moe_layer_step", "no_rope_layer_interval", "floor_scale")
        if self.lbl_coef is not None and not self.lbl_coef >= 0:
            raise ValueError(f"{name}.lbl_coef must be >= 0 (or null to turn it off), got {self.lbl_coef!r}")
        if self.attention_chunk_size is not None:
            check_positive(self, "attention_chunk_size")
        for key in ("moe_layers", "nope_layers"):
            layers = getattr(self, key)
            if layers is None:
                continue
            object.__setattr__(self, key, tuple(layers))  # a YAML/JSON list
            bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(
                    f"{name}.{key} must list layers from 0 to num_layers - 1 = {self.num_layers - 1}, got {bad[0]!r}"
                )
        if self.attention_chunk_size is not None and (
            self.use_flash_attention or self.attn_backend not in ("default", "vanilla")
        ):
            raise ValueError(
                f"{name}: chunked attention (attention_chunk_size) is computed by our plain attention kernel only; set "
                "attn_backend: default (or vanilla) and use_flash_attention: false, or attention_chunk_size: null"
            )
        super().__post_init__()

    def sparse_layers(self) -> tuple[int, ...]:
        """The layers (from 0) with a mixture of experts."""
        if self.moe_layers is not None:
            return tuple(sorted(set(self.moe_layers)))
        step = self.interleave_moe_layer_step
        return tuple(range(step - 1, self.num_layers, step))

    def nope_layer_list(self) -> tuple[int, ...]:
        """The layers (from 0) without RoPE."""
        if self.nope_layers is not None:
            return tuple(sorted(set(self.nope_layers)))
        return tuple(i for i in range(self.num_layers) if (i + 1) % self.no_rope_layer_interval == 0)

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks: chunked RoPE and global NoPE attention, shared-expert mixtures among dense MLPs."""
        sparse = self.sparse_layers()
        return DecoderSpec(
            qkv_bias=self.attention_bias,
            out_bias=self.attention_bias,
            num_experts=self.n_routed_experts,
            experts_per_token=self.num_experts_per_tok,
            moe_block_size=self.moe_block_size,
            expert_dim=self.moe_intermediate_dim,
            dense_layers=tuple(i for i in range(self.num_layers) if i not in sparse),
            shared_expert=True,
            nope_layers=self.nope_layer_list(),
            rope_interleaved=True,
            attention_chunk_size=self.attention_chunk_size,
            rope_qk_l2_norm=self.use_qk_norm,
            nope_temperature=(float(self.floor_scale), float(self.attn_scale))
            if self.attn_temperature_tuning
            else None,
        )

    def aux_loss_weights(self) -> dict[str, float]:
        """lbl_coef for router_aux_loss (0 when null)."""
        return {"router_aux_loss": float(self.lbl_coef or 0.0)}

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """The decoder's count (active experts, routers) plus the shared expert of every sparse layer, with the
        RoPE layers' attention over their chunk only (as sliding windows count theirs)."""
        shared = 3 * self.hidden_dim * self.moe_intermediate_dim * len(self.sparse_layers())
        length = seq_len or self.seq_len
        chunked = self.num_layers - len(self.nope_layer_list()) if self.attention_chunk_size is not None else 0
        cut = length - min(self.attention_chunk_size or length, length)
        saved = attention_flops_per_token(
            num_layers=chunked, seq_len=cut, num_heads=self.num_heads, head_size=self.HeadSize.size
        )
        return super().flops_per_token(vocab_size, seq_len) + training_flops_per_token(shared, -saved)


def llama4_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Llama4Config keyword arguments from a Llama 4 text config.json (model_type llama4_text)."""
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    # transformers' intermediate_size is the experts' width; the dense layers' is intermediate_size_mlp.
    kwargs["moe_intermediate_dim"] = kwargs.pop("intermediate_dim")
    kwargs["intermediate_dim"] = r.require("intermediate_size_mlp")
    # output_router_logits only says whether transformers returns the router logits; router_jitter_noise is read
    # by no layer of transformers' Llama 4.
    r.ignore("output_router_logits", "router_jitter_noise")
    layers = kwargs["num_layers"]
    interval = r.get("no_rope_layer_interval", 4)
    flags = r.get("no_rope_layers")
    # transformers' no_rope_layers holds 1 for a layer that uses RoPE and 0 for a NoPE layer.
    if flags and (len(flags) < layers or any(f not in (0, 1) for f in flags)):
        raise r.fail("no_rope_layers", f"must hold a 0 or 1 for each of the {layers} layers")
    # Lists that say what the interval and the step say are left to them (null), so that configs round trip.
    by_interval = [i for i in range(layers) if (i + 1) % interval == 0]
    nope = [i for i in range(layers) if not flags[i]] if flags else None
    nope = None if nope == by_interval else nope
    step = r.get("interleave_moe_layer_step", 1)
    moe = r.get("moe_layers")
    sparse = sorted(set(moe)) if moe is not None else list(range(step - 1, layers, step))
    moe = None if sparse == list(range(step - 1, layers, step)) else moe
    kwargs.update(
        attention_bias=bool(r.get("attention_bias", False)),
        n_routed_experts=r.get("num_local_experts", 16),
        num_experts_per_tok=r.get("num_experts_per_tok", 1),
        interleave_moe_layer_step=step,
        moe_layers=None if moe is None else tuple(moe),
        no_rope_layer_interval=interval,
        nope_layers=None if nope is None else tuple(nope),
        attention_chunk_size=r.get("attention_chunk_size", 8192),
        use_qk_norm=bool(r.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(r.get("attn_temperature_tuning", True)),
        floor_scale=r.get("floor_scale", 8192),
        attn_scale=r.get("attn_scale", 0.1),
        lbl_coef=r.get("router_aux_loss_coef", 0.001),
    )
    chunk = kwargs["attention_chunk_size"]
    rope_flags = flags[:layers] if flags else [int((i + 1) % interval != 0) for i in range(layers)]
    expected = [CHUNKED if f and chunk is not None else FULL for f in rope_flags]
    given = r.get("layer_types")
    if given is not None and list(given) != expected:
        raise r.fail(
            "layer_types",
            f"differs from the layer types that no_rope_layers and attention_chunk_size give ({expected}); "
            "lm_models cannot represent this layer pattern, and converting would change the model",
        )
    if sparse and len(sparse) < layers:
        kwargs["scan_layers"] = False  # dense and sparse layers cannot share one scan
    r.finish()
    return kwargs


def llama4_to_hf(config: Llama4Config, vocab_size: int) -> dict[str, Any]:
    """A Llama 4 text config.json (the family's keys) for our config."""
    nope = set(config.nope_layer_list())
    chunk = config.attention_chunk_size
    return {
        **common_to_hf(config, vocab_size),
        "intermediate_size": config.moe_intermediate_dim,
        "intermediate_size_mlp": config.intermediate_dim,
        "attention_bias": config.attention_bias,
        "num_local_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "interleave_moe_layer_step": config.interleave_moe_layer_step,
        "moe_layers": list(config.sparse_layers()),
        "no_rope_layer_interval": config.no_rope_layer_interval,
        "no_rope_layers": [int(i not in nope) for i in range(config.num_layers)],
        "layer_types": [CHUNKED if i not in nope and chunk is not None else FULL for i in range(config.num_layers)],
        "attention_chunk_size": chunk,
        "use_qk_norm": config.use_qk_norm,
        "attn_temperature_tuning": config.attn_temperature_tuning,
        "floor_scale": config.floor_scale,
        "attn_scale": config.attn_scale,
        "router_aux_loss_coef": config.lbl_coef or 0.0,
    }


def llama4_experts(h: str, layers: tuple[int, ...] | None) -> list[HfTensor]:
    """Llama 4's mixture in layer prefix `h` as transformers stores it: the router, every expert's weights in one
    tensor each, laid out (experts, in, out) with gate then up in gate_up_proj, and the shared expert."""
    m = h + "feed_forward."
    both = ("experts", "embed", "mlp")
    gate_up = fused(m + "experts.gate_up_proj", 2, ("mlp.experts.gate", both), ("mlp.experts.up", both))
    return [
        tensor(m + "router.weight", "mlp.router.weight", "experts", "embed", layers=layers),
        dataclasses.replace(gate_up, layers=layers),
        tensor(m + "experts.down_proj", "mlp.experts.down", "experts", "mlp", "embed", layers=layers),
        tensor(m + "shared_expert.gate_proj.weight", "mlp.shared.gate.weight", "mlp", "embed", layers=layers),
        tensor(m + "shared_expert.up_proj.weight", "mlp.shared.up.weight", "mlp", "embed", layers=layers),
        tensor(m + "shared_expert.down_proj.weight", "mlp.shared.down.weight", "embed", "mlp", layers=layers),
    ]


# Llama 4's released checkpoints are Llama4ForConditionalGeneration: the text model under text_config and
# language_model., beside a vision tower and projector that lm_models does not have.
LLAMA4_MULTIMODAL = HfWrapper(
    model_type="llama4",
    config_key="text_config",
    weight_prefix="language_model.",
    left_out=("vision_model.", "multi_modal_projector."),
    ignored_keys=("vision_config", "boi_token_index", "eoi_token_index", "image_token_index"),
    note="a multimodal Llama 4: its text model is imported, its vision tower and projector are left out",
)
Llama4Config.hf_mapping = dataclasses.replace(
    decoder_mapping(
        "llama4_text", "Llama4ForCausalLM", llama4_from_hf, llama4_to_hf, LLAMA_NORMS, llama4_experts, "feed_forward"
    ),
    wrappers=(LLAMA4_MULTIMODAL,),
)
