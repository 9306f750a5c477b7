"""DeepSeek-V3: multi-head latent attention, and a mixture of fine-grained experts with shared experts and
sigmoid, group-limited routing after the first dense layers (the config and its Hugging Face mapping; the model is
in lm_models.deepseek_v3_model)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import named_tensors as nt

from .config import LmConfig, check_positive
from .decoder_config import DecoderConfig, DecoderSpec
from .decoder_hf import LLAMA_NORMS, common_from_hf, common_to_hf
from .flops import attention_flops_per_token, training_flops_per_token
from .hf_config import HfConfigReader
from .hf_layout import HfMapping, HfTensor, Part, fused, split, tensor

MTP_INPUT = "mtp_input"  # the concatenated [embedding; hidden state] that an MTP depth's eh_proj maps back to embed


@LmConfig.register_subclass("deepseek_v3")
@dataclass(frozen=True)
class DeepseekV3Config(DecoderConfig):
    """DeepSeek-V3 hyperparameters (defaults: transformers' DeepseekV3Config, DeepSeek-V3's shape).

    Attention is multi-head latent attention (named_tensors.nn.LatentAttention): queries through a rank-q_lora_rank
    bottleneck (null: one projection), keys and values rebuilt per head from a kv_lora_rank latent, each head's
    key and query being qk_nope_head_dim unrotated features then qk_rope_head_dim rotated ones (one rotated key
    shared by all heads), values of v_head_dim. The scores' scale is 1/sqrt(qk_nope + qk_rope), times YaRN's
    mscale(factor, mscale_all_dim)² under a yarn rope with mscale_all_dim. Layers 0 .. first_k_dense_replace - 1
    have a dense gated MLP of intermediate_dim; the others a mixture (named_tensors.nn.GroupLimitedMoE) of
    n_routed_experts experts of moe_intermediate_dim, num_experts_per_tok per token among the topk_group best of
    n_group groups, chosen on sigmoid scores plus a per-expert correction bias, weighted by the scores
    (renormalised when norm_topk_prob) times routed_scaling_factor, plus n_shared_experts shared experts. The model
    reports router_aux_loss, DeepSeek-V3's sequence-wise balance loss, weighted by lbl_coef. A model that mixes
    dense and sparse layers runs them unrolled (scan_layers: false). Only our plain attention kernel runs it.
    """

    seq_len: int = 4096
    hidden_dim: int = 7168
    intermediate_dim: int = 18432
    num_layers: int = 61
    num_heads: int = 128
    num_kv_heads: int | None = None  # type: ignore[assignment]
    """Always num_heads (latent attention rebuilds keys per head); null: num_heads."""
    scan_layers: bool = False
    """One scan over the layers; it needs every layer of one kind (first_k_dense_replace 0 or num_layers), so the
    default (3 dense layers first) runs them unrolled."""
    head_dim: int | None = None
    """The rotated part of a head, which RoPE sees: always qk_rope_head_dim; null: qk_rope_head_dim."""
    q_lora_rank: int | None = 1536
    """Rank of the query bottleneck (q_a_proj, its RMSNorm, q_b_proj); null: one q_proj."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent per position (what the decoding cache holds)."""
    qk_nope_head_dim: int = 128
    """Features per head of queries and keys that RoPE does not rotate."""
    qk_rope_head_dim: int = 64
    """Features per head of queries and keys that RoPE rotates (the key's are shared by every head)."""
    v_head_dim: int = 128
    """Features per head of the values."""
    rope_interleave: bool = True
    """The rotated features are stored as interleaved pairs (DeepSeek's layout); false: as two halves."""
    attention_bias: bool = False
    """Biases on q_a_proj, kv_a_proj_with_mqa and o_proj."""
    moe_intermediate_dim: int = 2048
    """The hidden width of each routed expert (and of each shared expert)."""
    n_routed_experts: int = 256
    """Routed experts per sparse layer."""
    num_experts_per_tok: int = 8
    """Routed experts each token goes to (top-k)."""
    n_shared_experts: int = 1
    """Shared experts every token goes through in a sparse layer (0: none)."""
    n_group: int = 8
    """Groups the routed experts are cut into (each of at least 2 experts)."""
    topk_group: int = 4
    """Groups, rated by the sum of their two best scores, that a token's experts are chosen from."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' scores to sum to one before routed_scaling_factor."""
    routed_scaling_factor: float = 2.5
    """Multiplies the routed experts' weights."""
    first_k_dense_replace: int = 3
    """The first this-many layers have a dense MLP."""
    lbl_coef: float | None = 0.0001
    """Weight of router_aux_loss (the sequence-wise balance loss, DeepSeek-V3's alpha) in the training loss; null
    or 0: not added."""
    moe_block_size: int = nt.DEFAULT_MOE_BLOCK_SIZE
    """Token rows per block of the expert dispatch: a speed knob that does not change the result."""
    bias_update_speed: float = 0.0
    """DeepSeek-V3's aux-loss-free balancing (its gamma): after each train step, every sparse layer's correction
    bias moves by this much up for the experts loaded under the mean, down for those over, outside the gradient.
    0: off (the biases stay as built or imported). DeepSeek-V3 used 0.001."""
    mtp_depth: int = 0
    """Multi-token prediction depths (DeepSeek-V3 trained with 1): depth k predicts the token k + 1 ahead through
    one more block and the shared embedding and head. Exports hold them as DeepSeek-V3's release does (layer
    num_layers + k - 1; transformers skips them); an import reads them only when this is set, and fails when the
    checkpoint lacks them. 0: none."""
    mtp_loss_weight: float = 0.3
    """The weight of mtp_loss (the mean of the depths' cross-entropies, DeepSeek-V3's lambda) in the training loss."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.mtp_depth, bool) or not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ValueError(
                f"{name}.mtp_depth must be an int >= 0 (0: no multi-token prediction), got {self.mtp_depth!r}"
            )
        if self.mtp_depth and not self.mtp_depth < self.seq_len - 1:
            raise ValueError(
                f"{name}.mtp_depth={self.mtp_depth} leaves no token to predict in seq_len={self.seq_len}: lower it"
            )
        if not self.mtp_loss_weight >= 0:
            raise ValueError(f"{name}.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight!r}")
        if not self.bias_update_speed >= 0:
            raise ValueError(f"{name}.bias_update_speed must be >= 0 (0 turns it off), got {self.bias_update_speed!r}")
        check_positive(self, "n_routed_experts", "num_experts_per_tok", "moe_block_size")
        if self.lbl_coef is not None and not self.lbl_coef >= 0:
            raise ValueError(f"{name}.lbl_coef must be >= 0 (or null to turn it off), got {self.lbl_coef!r}")
        check_positive(self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group")
        check_positive(self, "topk_group", "moe_intermediate_dim")
        if self.q_lora_rank is not None:
            check_positive(self, "q_lora_rank")
        for key, value, default in (("num_kv_heads", self.num_kv_heads, self.num_heads),
                                    ("head_dim", self.head_dim, self.qk_rope_head_dim)):  # fmt: skip
            if value is None:
                object.__setattr__(self, key, default)
            elif value != default:
                raise ValueError(
                    f"{name}.{key} is {default} here (latent attention fixes it); got {value!r}: leave it out"
                )
        if isinstance(self.n_shared_experts, bool) or not isinstance(self.n_shared_experts, int):
            raise ValueError(f"{name}.n_shared_experts must be an int >= 0, got {self.n_shared_experts!r}")
        if self.n_shared_experts < 0:
            raise ValueError(f"{name}.n_shared_experts must be >= 0, got {self.n_shared_experts!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(
                f"{name}.first_k_dense_replace must be between 0 and num_layers={self.num_layers}, got "
                f"{self.first_k_dense_replace!r}"
            )
        E, G = self.n_routed_experts, self.n_group
        if E % G or E // G < 2 or not self.topk_group <= G:
            raise ValueError(
                f"{name}: n_routed_experts={E} must split into n_group={G} equal groups of at least 2 experts, and "
                f"topk_group={self.topk_group} must be at most n_group"
            )
        if self.num_experts_per_tok > E // G * self.topk_group:
            raise ValueError(
                f"{name}: num_experts_per_tok={self.num_experts_per_tok} exceeds the {E // G * self.topk_group} "
                "experts of the topk_group groups a token may choose from"
            )
        if self.use_flash_attention or self.attn_backend not in ("default", "vanilla"):
            raise ValueError(
                f"{name}: latent attention runs on our plain attention kernel only; set attn_backend: default (or "
                "vanilla) and use_flash_attention: false"
            )
        super().__post_init__()

    model_class = "lm_models.deepseek_v3_model:DeepseekV3LMHeadModel"

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks; the first_k_dense_replace layers dense, the others sparse (the attention and the
        mixture are DeepSeek-V3's own: see DeepseekV3LMHeadModel)."""
        return DecoderSpec(
            num_experts=self.n_routed_experts,
            experts_per_token=self.num_experts_per_tok,
            moe_block_size=self.moe_block_size,
            expert_dim=self.moe_intermediate_dim,
            normalize_expert_weights=self.norm_topk_prob,
            dense_layers=tuple(range(self.first_k_dense_replace)),
        )

    def attention_scale(self) -> float:
        """The scores' scale: 1/sqrt(qk_nope + qk_rope), times YaRN's mscale² as DeepSeek-V3 applies it."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        r = self.rope
        if r.type == "yarn" and r.mscale_all_dim and r.factor > 1:
            mscale = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
            scale *= mscale * mscale
        return scale

    def aux_loss_weights(self) -> dict[str, float]:
        """lbl_coef for router_aux_loss (0 when null), and mtp_loss_weight for mtp_loss with mtp_depth > 0."""
        weights = {"router_aux_loss": float(self.lbl_coef or 0.0)}
        if self.mtp_depth:
            weights["mtp_loss"] = float(self.mtp_loss_weight)
        return weights

    def needs_plain_positions(self) -> str | None:
        """With mtp_depth > 0: the multi-token prediction depths read the tokens ahead along the sequence, which
        packed documents and context parallelism's reordered positions break."""
        if not self.mtp_depth:
            return None
        return (
            f"model.mtp_depth={self.mtp_depth}: DeepSeek-V3's multi-token prediction reads the tokens ahead in one "
            "whole sequence in order"
        )

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token: latent attention's projections, the active experts, the head."""
        H, heads = self.hidden_dim, self.num_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q_rank = self.q_lora_rank
        query = H * heads * qk if q_rank is None else H * q_rank + q_rank * heads * qk
        kv = H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        attention_weights = query + kv + heads * self.v_head_dim * H
        dense = 3 * H * self.intermediate_dim
        sparse = 3 * H * self.moe_intermediate_dim * (self.num_experts_per_tok + self.n_shared_experts)
        sparse += H * self.n_routed_experts
        k = self.first_k_dense_replace
        weights = self.num_layers * attention_weights + k * dense + (self.num_layers - k) * sparse + H * vocab_size
        # Each MTP depth: a block of the last layer's kind, the projection of [embedding; hidden], the shared head.
        last = sparse if k < self.num_layers else dense
        weights += self.mtp_depth * (attention_weights + last + 2 * H * H + H * vocab_size)
        # Scores over qk features and the mix over v features: the mean of the two as the "head size".
        attention = attention_flops_per_token(
            num_layers=self.num_layers, seq_len=seq_len or self.seq_len, num_heads=heads,
            head_size=(qk + self.v_head_dim) // 2,
        )  # fmt: skip
        return training_flops_per_token(weights, attention)


def deepseek_v3_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """DeepseekV3Config keyword arguments from a DeepSeek-V3 config.json.

    mtp_depth stays 0 whatever num_nextn_predict_layers says: transformers writes 1 there with no weights for it,
    so the multi-token prediction modules are read only when the caller sets mtp_depth (config overrides, or
    model.mtp_depth in lm-train). lbl_coef comes from DeepSeek's aux_loss_alpha (0.0001 when absent).
    """
    r = HfConfigReader(hf, where)
    kwargs = common_from_hf(r)
    heads = kwargs["num_heads"]
    if kwargs.pop("num_kv_heads") != heads:
        raise r.fail(
            "num_key_value_heads",
            f"must equal num_attention_heads={heads}: latent attention rebuilds keys and values for every head",
        )
    rope_dim = r.require("qk_rope_head_dim")
    kwargs.pop("head_dim")  # common_from_hf's hidden_size / heads when absent, as DeepSeek's own files have it
    if hf.get("head_dim") is not None and hf["head_dim"] != rope_dim:
        raise r.fail("head_dim", f"must equal qk_rope_head_dim={rope_dim} (transformers sets it so)")
    # qk_head_dim is qk_nope_head_dim + qk_rope_head_dim; output_router_logits only says what transformers returns.
    r.ignore("qk_head_dim", "output_router_logits", "num_nextn_predict_layers", "num_mtp_layers")
    # DeepSeek's own config.json spells out the routing that transformers' model fixes; ep_size is a layout.
    r.expect("scoring_func", "sigmoid", ("sigmoid",), "DeepSeek-V3 scores experts with a sigmoid")
    r.expect("topk_method", "noaux_tc", ("noaux_tc",), "DeepSeek-V3 picks experts by group with a correction bias")
    r.expect("moe_layer_freq", 1, (1,), "every layer after first_k_dense_replace is sparse")
    r.ignore("seq_aux", "ep_size")
    layers = kwargs["num_layers"]
    first_dense = r.get("first_k_dense_replace", 3)
    kwargs.update(
        # A null q_lora_rank means one q_proj; only an absent key takes transformers' default.
        q_lora_rank=r.get("q_lora_rank") if "q_lora_rank" in hf else 1536,
        kv_lora_rank=r.require("kv_lora_rank"),
        qk_nope_head_dim=r.require("qk_nope_head_dim"),
        qk_rope_head_dim=rope_dim,
        v_head_dim=r.require("v_head_dim"),
        rope_interleave=bool(r.get("rope_interleave", True)),
        attention_bias=bool(r.get("attention_bias", False)),
        moe_intermediate_dim=r.require("moe_intermediate_size"),
        n_routed_experts=r.require("n_routed_experts"),
        num_experts_per_tok=r.get("num_experts_per_tok", 8),
        n_shared_experts=r.get("n_shared_experts", 1),
        n_group=r.get("n_group", 8),
        topk_group=r.get("topk_group", 4),
        norm_topk_prob=bool(r.get("norm_topk_prob", True)),
        routed_scaling_factor=float(r.get("routed_scaling_factor", 2.5)),
        first_k_dense_replace=first_dense,
        lbl_coef=r.get("aux_loss_alpha", 0.0001),
    )
    if 0 < first_dense < layers:
        kwargs["scan_layers"] = False  # dense and sparse layers cannot share one scan
    r.finish()
    return kwargs


def deepseek_v3_to_hf(config: DeepseekV3Config, vocab_size: int) -> dict[str, Any]:
    """A DeepSeek-V3 config.json (the family's keys) for our config; num_nextn_predict_layers is mtp_depth."""
    out = common_to_hf(config, vocab_size)
    return {
        **out,
        "qk_head_dim": config.qk_nope_head_dim + config.qk_rope_head_dim,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        "attention_bias": config.attention_bias,
        "moe_intermediate_size": config.moe_intermediate_dim,
        "n_routed_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "n_shared_experts": config.n_shared_experts,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "norm_topk_prob": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor,
        "first_k_dense_replace": config.first_k_dense_replace,
        "num_nextn_predict_layers": config.mtp_depth,
        # DeepSeek's key for the balance loss's weight; transformers keeps it as a plain attribute.
        "aux_loss_alpha": config.lbl_coef or 0.0,
    }


def deepseek_v3_tensors(config: DeepseekV3Config) -> list[HfTensor]:
    """Every tensor of a DeepSeek-V3 checkpoint: Llama's embeddings, norms, dense MLP and head, latent attention,
    the experts as transformers writes them (one gate_proj/up_proj/down_proj per expert, the router as mlp.gate
    with its e_score_correction_bias, the shared experts as one gated MLP), and with mtp_depth > 0 the multi-token
    prediction modules as DeepSeek-V3's release stores them (mtp_tensors)."""
    k, n = config.first_k_dense_replace, config.num_layers
    dense, sparse = tuple(range(k)), tuple(range(k, n))
    # In a model of one kind of layer, the tensors are in every layer (None), as the scanned stack expects.
    out = [tensor("model.embed_tokens.weight", "embed_tokens.weight", "vocab", "embed")]
    out += layer_tensors(
        config, "model.layers.{layer}.", dense=None if k == n else dense, sparse=None if k == 0 else sparse
    )
    out.append(tensor("model.norm.weight", "norm.weight", "embed"))
    if not config.tie_word_embeddings:
        out.append(tensor("lm_head.weight", "lm_head.weight", "vocab", "embed"))
    return out + mtp_tensors(config)


def layer_tensors(
    config: DeepseekV3Config, h: str, *, dense: tuple[int, ...] | None, sparse: tuple[int, ...] | None
) -> list[HfTensor]:
    """The tensors of the decoder layers under key prefix `h`: norms, latent attention, the dense MLP in the layers
    `dense` and the mixture in the layers `sparse` (None: every layer; (): none)."""
    a = h + "self_attn."
    out = [tensor(h + hf + ".weight", ours + ".weight", "embed") for ours, hf in LLAMA_NORMS.items()]
    out += [
        tensor(a + "kv_a_layernorm.weight", "self_attn.kv_a_norm.weight", "kv_lora"),
        fused(
            a + "kv_a_proj_with_mqa.weight", 0,
            ("self_attn.kv_a_proj.weight", ("kv_lora", "embed")),
            ("self_attn.k_rope_proj.weight", ("qk_rope", "embed")),
        ),
        tensor(a + "kv_b_proj.weight", "self_attn.kv_b_proj.weight", ("heads", "kv_head"), "kv_lora"),
        tensor(a + "o_proj.weight", "self_attn.o_proj.weight", "embed", ("heads", "v_head")),
    ]  # fmt: skip
    if config.attention_bias:
        out += [
            fused(a + "kv_a_proj_with_mqa.bias", 0, ("self_attn.kv_a_proj.bias", ("kv_lora",)),
                  ("self_attn.k_rope_proj.bias", ("qk_rope",))),
            tensor(a + "o_proj.bias", "self_attn.o_proj.bias", "embed"),
        ]  # fmt: skip
    if config.q_lora_rank is None:
        out.append(tensor(a + "q_proj.weight", "self_attn.q_proj.weight", ("heads", "head_size"), "embed"))
    else:
        out += [
            tensor(a + "q_a_proj.weight", "self_attn.q_a_proj.weight", "q_lora", "embed"),
            tensor(a + "q_a_layernorm.weight", "self_attn.q_a_norm.weight", "q_lora"),
            tensor(a + "q_b_proj.weight", "self_attn.q_b_proj.weight", ("heads", "head_size"), "q_lora"),
        ]
        if config.attention_bias:
            out.append(tensor(a + "q_a_proj.bias", "self_attn.q_a_proj.bias", "q_lora"))
    gated = (("gate_proj", "gate", ("mlp", "embed")), ("up_proj", "up", ("mlp", "embed")),
             ("down_proj", "down", ("embed", "mlp")))  # fmt: skip
    if dense != ():
        out += [
            tensor(h + f"mlp.{hf}.weight", f"mlp.{ours}.weight", *layout, layers=dense) for hf, ours, layout in gated
        ]
    if sparse != ():
        m, e = h + "mlp.", h + "mlp.experts.{expert}."
        out += [
            tensor(m + "gate.weight", "mlp.router.weight", "experts", "embed", layers=sparse),
            tensor(m + "gate.e_score_correction_bias", "mlp.correction_bias", "experts", layers=sparse),
            split(e + "gate_proj.weight", "mlp.experts.gate", "experts", "mlp", "embed", layers=sparse),
            split(e + "up_proj.weight", "mlp.experts.up", "experts", "mlp", "embed", layers=sparse),
            split(e + "down_proj.weight", "mlp.experts.down", "experts", "embed", "mlp", layers=sparse),
        ]
        if config.n_shared_experts:
            out += [
                tensor(m + f"shared_experts.{hf}.weight", f"mlp.shared.{ours}.weight", *layout, layers=sparse)
                for hf, ours, layout in gated
            ]
    return out


def mtp_tensors(config: DeepseekV3Config) -> list[HfTensor]:
    """The multi-token prediction depths as DeepSeek-V3's release stores them (its README_WEIGHTS.md): depth i as
    layer num_layers + i, holding enorm, hnorm, eh_proj, shared_head.norm, one decoder layer of the last layer's
    kind, and copies of the shared embedding (embed_tokens) and head (shared_head.head)."""
    last_sparse = config.first_k_dense_replace < config.num_layers
    head = "embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    out = []
    for i in range(config.mtp_depth):
        index = config.num_layers + i
        h, ours = f"model.layers.{index}.", f"mtp.{i}."
        hint = (
            f"model.mtp_depth={config.mtp_depth} needs multi-token prediction module {i + 1} (tensors "
            f"{h}enorm.weight, {h}eh_proj.weight, ... as DeepSeek-V3's release stores them), which this checkpoint "
            "lacks (transformers' exports have none): lower model.mtp_depth (0 loads the main model alone), or "
            "start from a checkpoint that holds them"
        )
        own = [
            tensor(h + "enorm.weight", ours + "enorm.weight", "embed"),
            tensor(h + "hnorm.weight", ours + "hnorm.weight", "embed"),
            tensor(h + "eh_proj.weight", ours + "eh_proj.weight", "embed", MTP_INPUT),
            tensor(h + "shared_head.norm.weight", ours + "norm.weight", "embed"),
        ]
        block = layer_tensors(config, h, dense=None if not last_sparse else (), sparse=None if last_sparse else ())
        block = [
            dataclasses.replace(spec, parts=tuple(Part(ours + "block." + p.path, p.layout) for p in spec.parts))
            for spec in block
        ]
        out += [dataclasses.replace(spec, missing_hint=hint) for spec in own + block]
        out += [
            dataclasses.replace(tensor(h + "embed_tokens.weight", "embed_tokens.weight", "vocab", "embed"),
                                duplicate=True),
            dataclasses.replace(tensor(h + "shared_head.head.weight", head, "vocab", "embed"), duplicate=True),
        ]  # fmt: skip
    return out


def mtp_unused(config: DeepseekV3Config, key: str) -> bool:
    """Whether a checkpoint key belongs to a multi-token prediction module past the config's mtp_depth."""
    found = _LAYER_KEY.match(key)
    return found is not None and int(found.group(1)) >= config.num_layers + config.mtp_depth


_LAYER_KEY = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


DeepseekV3Config.hf_mapping = HfMapping(
    hf_model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    config_from_hf=deepseek_v3_from_hf,
    config_to_hf=deepseek_v3_to_hf,
    tensors=deepseek_v3_tensors,
    base_prefix="model.",
    ignored_suffixes=(".rotary_emb.inv_freq",),
    unused=mtp_unused,
)
