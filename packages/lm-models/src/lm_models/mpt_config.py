"""MPT's config, without jax: the model is in lm_models.mpt."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from named_tensors import Axis

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
from .flops import mha_flops_per_token
from .hf_config import GENERIC_KEYS, HfConfigError, HfConfigReader
from .hf_layout import HfMapping, HfTensor, fused, tensor

if TYPE_CHECKING:
    from .attention import AttentionOptions


@LmConfig.register_subclass("mpt")
@dataclass(frozen=True)
class MptConfig(LmConfig):
    """MPT hyperparameters; `intermediate_dim` overrides `expansion_ratio * hidden_dim` when set."""

    seq_len: int = 2048
    hidden_dim: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    expansion_ratio: int = 4
    """The MLP's hidden width as a multiple of hidden_dim (unless intermediate_dim is set)."""
    intermediate_dim: int | None = None
    """The MLP's hidden width; null: expansion_ratio * hidden_dim."""
    clip_qkv: float | None = None
    """Clamp queries, keys and values to [-clip_qkv, clip_qkv]; null: no clamping."""
    alibi_bias_max: float = 8.0
    """ALiBi's steepest exponent: head h = 1..H gets slope 2 ** (-alibi_bias_max * h / H) (H rounded up to 2^k)."""
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    embed_pdrop: float = 0.0
    """Dropout probability on the token embeddings, in [0, 1)."""
    resid_pdrop: float = 0.0
    """Dropout probability on each attention and MLP output before it joins the residual stream, in [0, 1)."""
    attn_pdrop: float = 0.0
    activation_function: str = "gelu"
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
        check_positive(self, "seq_len", "hidden_dim", "num_layers", "num_heads", "expansion_ratio")
        if self.intermediate_dim is not None:
            check_positive(self, "intermediate_dim")
        check_heads_divide(self)
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"MptConfig.clip_qkv must be positive (or null for no clipping), got {self.clip_qkv}")
        if not self.alibi_bias_max > 0:
            raise ValueError(f"MptConfig.alibi_bias_max must be positive, got {self.alibi_bias_max}")
        check_probability(self, "embed_pdrop", "resid_pdrop", "attn_pdrop")
        check_layer_stack(self)
        check_activation(self)

    @property
    def Mlp(self) -> Axis:
        size = self.intermediate_dim if self.intermediate_dim is not None else self.expansion_ratio * self.hidden_dim
        return Axis("mlp", size)

    def attention_options(self) -> AttentionOptions:
        """The attention layer's settings for this config."""
        from .attention import AttentionOptions

        return AttentionOptions.of_config(
            self, use_bias=False, clip_qkv=self.clip_qkv, alibi_max_bias=self.alibi_bias_max
        )

    model_class = "lm_models.mpt:MptLMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token (see lm_models.flops for the formula)."""
        return mha_flops_per_token(self, vocab_size, seq_len)


HEAD = ("heads", "head_size")
# transformers' MptMLP and its ALiBi call hard-code these, whatever config.json says.
HF_EXPANSION_RATIO = 4
HF_ALIBI_BIAS_MAX = 8.0


def mpt_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """MptConfig keyword arguments from an MPT config.json."""
    r = HfConfigReader(hf, where)
    hidden = r.require("d_model")
    heads = r.require("n_heads")
    r.expect("no_bias", True, (True,), "lm_models' MPT has no biases")
    r.expect("logit_scale", None, (None,), "lm_models' MPT does not scale its logits")
    r.expect("embedding_fraction", 1.0, (1.0,), "lm_models' MPT trains the embeddings at full rate")
    r.expect("norm_type", "low_precision_layernorm", ("low_precision_layernorm", "layernorm"), "LayerNorm only")
    r.expect("tie_word_embeddings", True, (True,), "MptForCausalLM ties its output head to wte")
    r.expect("ffn_config", None, (None, {"ffn_type": "mptmlp"}), "lm_models' MPT has the plain GELU MLP")
    # With ALiBi, transformers' MPT has no learned position table whatever learned_pos_emb says.
    r.ignore("learned_pos_emb", "init_device", "init_config", "vocab_size", "verbose", "fc_type", "tokenizer_name")
    r.ignore("expansion_ratio")
    attn = _attention_from_hf(r.get("attn_config", {}), hidden // heads, f"{where} attn_config")
    kwargs = {
        "seq_len": r.get("max_seq_len", 2048),
        "hidden_dim": hidden,
        "num_layers": r.require("n_layers"),
        "num_heads": heads,
        # transformers' MptMLP is 4 x d_model whatever expansion_ratio says: import the model it runs.
        "expansion_ratio": HF_EXPANSION_RATIO,
        "layer_norm_epsilon": r.get("layer_norm_epsilon", 1e-5),
        "initializer_range": r.get("initializer_range", 0.02),
        "embed_pdrop": r.get("emb_pdrop", 0.0),
        "resid_pdrop": r.get("resid_pdrop", 0.0),
        **attn,
    }
    r.finish()
    return kwargs


def _attention_from_hf(attn: Mapping[str, Any], head_size: int, where: str) -> dict[str, Any]:
    # transformers writes a whole nested config object here, generic keys included.
    r = HfConfigReader(attn, where, generic=GENERIC_KEYS | {"attn_impl"})
    r.expect("alibi", True, (True,), "lm_models' MPT uses ALiBi positions")
    r.expect("attn_type", "multihead_attention", ("multihead_attention",), "multi-head attention only")
    r.expect("qk_ln", False, (False,), "no LayerNorm on queries and keys")
    r.expect("prefix_lm", False, (False,), "causal attention only")
    r.expect("attn_uses_sequence_id", False, (False,), "no per-sequence masking")
    softmax_scale = r.get("softmax_scale")
    if softmax_scale is not None and not math.isclose(softmax_scale, head_size**-0.5, rel_tol=1e-6):
        raise r.fail("softmax_scale", f"lm_models' MPT scales attention by 1/sqrt(head_size) = {head_size**-0.5}")
    clip = r.get("clip_qkv")
    kwargs = {
        "clip_qkv": None if clip is None else float(clip),
        "alibi_bias_max": float(r.get("alibi_bias_max", 8)),
        "attn_pdrop": r.get("attn_pdrop", 0.0),
    }
    r.finish()
    return kwargs


def mpt_to_hf(config: MptConfig, vocab_size: int) -> dict[str, Any]:
    """An MPT config.json (the family's keys) for our config; only what transformers' MPT can represent."""
    if config.Mlp.size != HF_EXPANSION_RATIO * config.hidden_dim:
        raise HfConfigError(
            f"MptConfig with an MLP of {config.Mlp.size} = {config.Mlp.size / config.hidden_dim:g} x hidden_dim "
            f"cannot be exported: transformers' MptForCausalLM always builds a {HF_EXPANSION_RATIO} x hidden_dim "
            "MLP. Use expansion_ratio=4 (and no intermediate_dim) to export to Hugging Face."
        )
    if config.alibi_bias_max != HF_ALIBI_BIAS_MAX:
        raise HfConfigError(
            f"MptConfig(alibi_bias_max={config.alibi_bias_max}) cannot be exported: transformers' MptForCausalLM "
            f"always uses alibi_bias_max={HF_ALIBI_BIAS_MAX:g}. Use alibi_bias_max=8 to export to Hugging Face."
        )
    if config.activation_function != "gelu":
        raise HfConfigError(
            f"MptConfig(activation_function={config.activation_function!r}) cannot be exported: transformers' "
            "MPT always uses the exact GELU. Use activation_function='gelu' to export to Hugging Face."
        )
    return {
        "vocab_size": vocab_size,
        "max_seq_len": config.seq_len,
        "d_model": config.hidden_dim,
        "n_layers": config.num_layers,
        "n_heads": config.num_heads,
        "expansion_ratio": config.expansion_ratio,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "emb_pdrop": config.embed_pdrop,
        "resid_pdrop": config.resid_pdrop,
        "no_bias": True,
        "norm_type": "low_precision_layernorm",
        "learned_pos_emb": False,
        "tie_word_embeddings": True,
        "attn_config": {
            "alibi": True,
            # transformers' MptAttentionConfig declares an int here.
            "alibi_bias_max": int(config.alibi_bias_max),
            "clip_qkv": config.clip_qkv,
            # transformers 5 declares this an int and rejects 0.1; dropout does not change a loaded model's
            # outputs, so the export writes none (documented in docs/hf-bridge.md).
            "attn_pdrop": 0,
            "attn_type": "multihead_attention",
            "softmax_scale": None,
            "qk_ln": False,
            "prefix_lm": False,
            "attn_uses_sequence_id": False,
        },
    }


def mpt_tensors(config: MptConfig) -> list[HfTensor]:
    """Every tensor of an MptForCausalLM checkpoint (the head is tied to wte, so it is not stored)."""
    h = "transformer.blocks.{layer}."
    return [
        tensor("transformer.wte.weight", "wte.weight", "vocab", "embed"),
        tensor(h + "norm_1.weight", "norm_1.weight", "embed"),
        fused(
            h + "attn.Wqkv.weight",
            0,
            ("attn.q_proj.weight", (HEAD, "embed")),
            ("attn.k_proj.weight", (("kv_heads", "head_size"), "embed")),
            ("attn.v_proj.weight", (("kv_heads", "head_size"), "embed")),
        ),
        tensor(h + "attn.out_proj.weight", "attn.o_proj.weight", "embed", HEAD),
        tensor(h + "norm_2.weight", "norm_2.weight", "embed"),
        tensor(h + "ffn.up_proj.weight", "ffn.up.weight", "mlp", "embed"),
        tensor(h + "ffn.down_proj.weight", "ffn.down.weight", "embed", "mlp"),
        tensor("transformer.norm_f.weight", "norm_f.weight", "embed"),
    ]


MptConfig.hf_mapping = HfMapping(
    hf_model_type="mpt",
    architecture="MptForCausalLM",
    config_from_hf=mpt_from_hf,
    config_to_hf=mpt_to_hf,
    tensors=mpt_tensors,
    base_prefix="transformer.",
    ignored_suffixes=("lm_head.weight",),
)
