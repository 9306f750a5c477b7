"""Llama's config, without jax: the model is in lm_models.llama."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from named_tensors import ACTIVATION_NAMES, Axis

from .config import (
    LmConfig,
    check_activation,
    check_attn_backend,
    check_cross_entropy_block_size,
    check_heads_divide,
    check_layer_stack,
    check_positive,
    check_probability,
)
from .flops import attention_flops_per_token, training_flops_per_token, transformer_matmul_weights
from .hf_config import HfConfigError, HfConfigReader, max_positions_to_hf, rope_from_hf, rope_to_hf
from .hf_layout import HfMapping, HfTensor, tensor
from .rope import RopeConfig, rotary_embeddings

if TYPE_CHECKING:
    from .attention import AttentionOptions


@LmConfig.register_subclass("llama")
@dataclass(frozen=True)
class LlamaConfig(LmConfig):
    """Llama hyperparameters; the keys are Levanter's `llama` model keys."""

    seq_len: int = 2048
    hidden_dim: int = 4096
    intermediate_dim: int = 11008
    """The gated MLP's hidden width (the size of the `mlp` axis)."""
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    """Key/value heads (grouped-query attention); must divide num_heads; equal to num_heads: plain multi-head."""
    activation_function: str = "silu"
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    """Use the token embedding matrix as the output projection too (no separate lm_head)."""
    use_bias: bool = False
    """Biases on the attention and MLP projections."""
    use_layer_norm_weight: bool = True
    """A learned scale in every RMSNorm; false: normalise only."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """Rotary position embeddings: `rope.type` and its scaling keys below."""
    attn_pdrop: float = 0.0
    upcast_attn: bool = False
    gradient_checkpointing: bool | str = True
    scan_layers: bool = True
    scan_unroll: bool | int | str = "auto"
    use_flash_attention: bool = False
    flash_attention_block_size: int | None = None
    attn_backend: str = "default"
    cross_entropy_block_size: int | None = None

    def __post_init__(self) -> None:
        check_attn_backend(self)
        check_cross_entropy_block_size(self)
        check_positive(self, "seq_len", "hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads")
        check_heads_divide(self)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig: num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}; "
                "each key/value head serves an equal group of query heads"
            )
        if (self.hidden_dim // self.num_heads) % 2:
            raise ValueError(
                f"LlamaConfig: the head size hidden_dim / num_heads = {self.hidden_dim // self.num_heads} "
                "must be even for rotary embeddings"
            )
        if isinstance(self.rope, dict):  # built from a plain mapping (e.g. JSON) rather than by a config parser
            object.__setattr__(self, "rope", RopeConfig(**self.rope))
        check_probability(self, "attn_pdrop")
        check_layer_stack(self)
        check_activation(self)

    @property
    def KVHeads(self) -> Axis:
        return Axis("kv_heads", self.num_kv_heads)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.intermediate_dim)

    def attention_options(self) -> AttentionOptions:
        """The attention layer's settings for this config."""
        from .attention import AttentionOptions

        return AttentionOptions(
            Embed=self.Embed,
            Heads=self.Heads,
            KVHeads=self.KVHeads,
            HeadSize=self.HeadSize,
            use_bias=self.use_bias,
            upcast_softmax=self.upcast_attn,
            dropout_rate=self.attn_pdrop,
            rotary=rotary_embeddings(self.rope, self.HeadSize.size),
            use_flash_attention=self.use_flash_attention,
            flash_block_size=self.flash_attention_block_size,
            backend=self.attn_backend,
        )

    model_class = "lm_models.llama:LlamaLMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token (see lm_models.flops for the formula)."""
        weights = transformer_matmul_weights(
            hidden_dim=self.hidden_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.HeadSize.size,
            mlp_dim=self.intermediate_dim,
            mlp_matrices=3,
            vocab_size=vocab_size,
        )
        attention = attention_flops_per_token(
            num_layers=self.num_layers,
            seq_len=seq_len or self.seq_len,
            num_heads=self.num_heads,
            head_size=self.HeadSize.size,
        )
        return training_flops_per_token(weights, attention)


HEAD = ("heads", "head_size")
KV_HEAD = ("kv_heads", "head_size")


def llama_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """LlamaConfig keyword arguments from a Llama config.json."""
    r = HfConfigReader(hf, where)
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    head_dim = r.get("head_dim", hidden // heads)
    if head_dim * heads != hidden:
        raise r.fail("head_dim", f"is not hidden_size / num_attention_heads = {hidden}/{heads}; lm_models' Llama "
                     "derives the head size from those two")  # fmt: skip
    attention_bias = r.get("attention_bias", False)
    mlp_bias = r.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise r.fail("mlp_bias", f"differs from attention_bias={attention_bias}; LlamaConfig.use_bias sets both")
    activation = r.get("hidden_act", "silu")
    if activation not in ACTIVATION_NAMES:
        raise r.fail("hidden_act", f"is not an activation hf_bridge knows: {list(ACTIVATION_NAMES)}")
    partial = r.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise r.fail("partial_rotary_factor", "lm_models' Llama rotates the whole head")
    # pretraining_tp only splits matmuls into slices in transformers 4: the same math.
    r.ignore("pretraining_tp", "vocab_size")
    kwargs = {
        "seq_len": r.get("max_position_embeddings", 2048),
        "hidden_dim": hidden,
        "intermediate_dim": r.require("intermediate_size"),
        "num_layers": r.require("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": r.get("num_key_value_heads", heads),
        "activation_function": activation,
        "initializer_range": r.get("initializer_range", 0.02),
        "layer_norm_epsilon": r.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": r.get("tie_word_embeddings", False),
        "use_bias": attention_bias,
        "attn_pdrop": r.get("attention_dropout", 0.0),
        "rope": rope_from_hf(r),
    }
    r.finish()
    return kwargs


def llama_to_hf(config: LlamaConfig, vocab_size: int) -> dict[str, Any]:
    """A Llama config.json (the family's keys) for our config."""
    if not config.use_layer_norm_weight:
        raise HfConfigError(
            "LlamaConfig(use_layer_norm_weight=False) cannot be exported: transformers' Llama norms always have "
            "a weight. Train with use_layer_norm_weight=true to export to Hugging Face."
        )
    theta, scaling = rope_to_hf(config.rope)
    return {
        "vocab_size": vocab_size,
        "max_position_embeddings": max_positions_to_hf(config.seq_len, config.rope),
        "hidden_size": config.hidden_dim,
        "intermediate_size": config.intermediate_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.HeadSize.size,
        "hidden_act": config.activation_function,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.use_bias,
        "mlp_bias": config.use_bias,
        "attention_dropout": config.attn_pdrop,
        "rope_theta": theta,
        "rope_scaling": scaling,
    }


def llama_tensors(config: LlamaConfig) -> list[HfTensor]:
    """Every tensor of a LlamaForCausalLM checkpoint for this config."""
    h = "model.layers.{layer}."
    out = [tensor("model.embed_tokens.weight", "embed_tokens.weight", "vocab", "embed")]
    if config.use_layer_norm_weight:
        out += [
            tensor(h + "input_layernorm.weight", "input_layernorm.weight", "embed"),
            tensor(h + "post_attention_layernorm.weight", "post_attention_layernorm.weight", "embed"),
        ]
    for name, heads in (("q_proj", HEAD), ("k_proj", KV_HEAD), ("v_proj", KV_HEAD)):
        out.append(tensor(h + f"self_attn.{name}.weight", f"self_attn.{name}.weight", heads, "embed"))
        if config.use_bias:
            out.append(tensor(h + f"self_attn.{name}.bias", f"self_attn.{name}.bias", heads))
    out.append(tensor(h + "self_attn.o_proj.weight", "self_attn.o_proj.weight", "embed", HEAD))
    for hf_name, ours, layout in (
        ("gate_proj", "gate", ("mlp", "embed")),
        ("up_proj", "up", ("mlp", "embed")),
        ("down_proj", "down", ("embed", "mlp")),
    ):
        out.append(tensor(h + f"mlp.{hf_name}.weight", f"mlp.{ours}.weight", *layout))
        if config.use_bias:
            out.append(tensor(h + f"mlp.{hf_name}.bias", f"mlp.{ours}.bias", layout[0]))
    if config.use_bias:
        out.append(tensor(h + "self_attn.o_proj.bias", "self_attn.o_proj.bias", "embed"))
    if config.use_layer_norm_weight:
        out.append(tensor("model.norm.weight", "norm.weight", "embed"))
    if not config.tie_word_embeddings:
        out.append(tensor("lm_head.weight", "lm_head.weight", "vocab", "embed"))
    return out


LlamaConfig.hf_mapping = HfMapping(
    hf_model_type="llama",
    architecture="LlamaForCausalLM",
    config_from_hf=llama_from_hf,
    config_to_hf=llama_to_hf,
    tensors=llama_tensors,
    base_prefix="model.",
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
