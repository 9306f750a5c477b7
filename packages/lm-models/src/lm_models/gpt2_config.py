"""GPT-2's config (and the GPT-2-style keys Backpack shares), without jax: the model is in lm_models.gpt2."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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
from .flops import mha_flops_per_token
from .hf_config import HfConfigError, HfConfigReader
from .hf_layout import HfMapping, HfTensor, fused, tensor

if TYPE_CHECKING:
    from .attention import AttentionOptions


@dataclass(frozen=True)
class Gpt2StyleConfig(LmConfig):
    """The GPT-2 keys (Levanter's), shared by GPT-2 and Backpack; not a model type of its own."""

    seq_len: int = 512
    hidden_dim: int = 768
    num_layers: int = 12
    num_heads: int = 12
    mlp_scale: int = 4
    """The MLP's hidden width as a multiple of hidden_dim."""
    initializer_range: float = 0.02
    embed_pdrop: float = 0.0
    """Dropout probability on the token + position embeddings, in [0, 1)."""
    resid_pdrop: float = 0.0
    """Dropout probability on each attention and MLP output before it joins the residual stream, in [0, 1)."""
    attn_pdrop: float = 0.0
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    scale_attn_by_inverse_layer_idx: bool = False
    """Divide layer i's attention scores by i + 1 (counting from 0), as GPT-2's option of that name."""
    upcast_attn: bool = False
    use_bias: bool = True
    """Biases in the attention and MLP projections and the LayerNorms."""
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
        check_positive(self, "seq_len", "hidden_dim", "num_layers", "num_heads", "mlp_scale")
        check_heads_divide(self)
        check_probability(self, "embed_pdrop", "resid_pdrop", "attn_pdrop")
        check_layer_stack(self)
        check_activation(self)

    @property
    def Mlp(self) -> Axis:
        return Axis("mlp", self.hidden_dim * self.mlp_scale)

    @property
    def max_positions(self) -> int:
        """GPT-2 learns one position embedding per slot, so sequences are at most seq_len long."""
        return self.seq_len

    def attention_options(self) -> AttentionOptions:
        """The attention layer's settings for this config."""
        from .attention import AttentionOptions

        return AttentionOptions.of_config(self, use_bias=self.use_bias)

    def transformer_flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token of the GPT-2 transformer and its tied head (see lm_models.flops)."""
        return mha_flops_per_token(self, vocab_size, seq_len)


@LmConfig.register_subclass("gpt2")
@dataclass(frozen=True)
class Gpt2Config(Gpt2StyleConfig):
    """GPT-2 hyperparameters; the keys are Levanter's `gpt2` model keys."""

    model_class = "lm_models.gpt2:Gpt2LMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token (see lm_models.flops for the formula)."""
        return self.transformer_flops_per_token(vocab_size, seq_len)


HEAD = ("heads", "head_size")
KV_HEAD = ("kv_heads", "head_size")


def gpt2_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gpt2Config keyword arguments from a GPT-2 config.json."""
    r = HfConfigReader(hf, where)
    r.expect("tie_word_embeddings", True, (True,), "Gpt2LMHeadModel always ties its output head to wte")
    kwargs = gpt2_keys_from_hf(r)
    r.finish()
    return kwargs


def gpt2_keys_from_hf(r: HfConfigReader) -> dict[str, Any]:
    """The GPT-2 keys of a config.json, as keyword arguments of a Gpt2StyleConfig (GPT-2 or Backpack)."""
    hidden = r.require("n_embd")
    positions = r.require("n_positions")
    n_ctx = r.get("n_ctx", positions)
    if n_ctx != positions:
        raise r.fail("n_ctx", f"differs from n_positions={positions}; GPT-2 needs one context length")
    inner = r.get("n_inner", 4 * hidden)
    if inner % hidden:
        raise r.fail("n_inner", f"is not a multiple of n_embd={hidden}; Gpt2Config sizes the MLP as mlp_scale * n_embd")
    activation = r.get("activation_function", "gelu_new")
    if activation not in ACTIVATION_NAMES:
        raise r.fail("activation_function", f"is not an activation hf_bridge knows: {list(ACTIVATION_NAMES)}")
    r.expect("scale_attn_weights", True, (True,), "GPT-2 without 1/sqrt(head_size) attention scaling")
    r.expect("add_cross_attention", False, (False,), "a causal LM has no cross-attention")
    r.ignore("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels")
    r.ignore("summary_first_dropout")
    kwargs = {
        "seq_len": positions,
        "hidden_dim": hidden,
        "num_layers": r.require("n_layer"),
        "num_heads": r.require("n_head"),
        "mlp_scale": inner // hidden,
        "initializer_range": r.get("initializer_range", 0.02),
        "embed_pdrop": r.get("embd_pdrop", 0.1),
        "resid_pdrop": r.get("resid_pdrop", 0.1),
        "attn_pdrop": r.get("attn_pdrop", 0.1),
        "layer_norm_epsilon": r.get("layer_norm_epsilon", 1e-5),
        "activation_function": activation,
        "scale_attn_by_inverse_layer_idx": r.get("scale_attn_by_inverse_layer_idx", False),
        "upcast_attn": r.get("reorder_and_upcast_attn", False),
    }
    r.ignore("vocab_size")
    return kwargs


def gpt2_to_hf(config: Gpt2Config, vocab_size: int) -> dict[str, Any]:
    """A GPT-2 config.json (the family's keys) for our config."""
    if not config.use_bias:
        raise HfConfigError(
            "Gpt2Config(use_bias=False) cannot be exported: transformers' GPT-2 always has biases. "
            "Train with use_bias=true to export to Hugging Face."
        )
    return gpt2_keys_to_hf(config, vocab_size)


def gpt2_keys_to_hf(config: Gpt2StyleConfig, vocab_size: int) -> dict[str, Any]:
    """The GPT-2 keys of a config.json for a Gpt2StyleConfig (GPT-2 or Backpack)."""
    return {
        "vocab_size": vocab_size,
        "n_positions": config.seq_len,
        "n_embd": config.hidden_dim,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.hidden_dim * config.mlp_scale,
        "activation_function": config.activation_function,
        "resid_pdrop": config.resid_pdrop,
        "embd_pdrop": config.embed_pdrop,
        "attn_pdrop": config.attn_pdrop,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": config.upcast_attn,
        "tie_word_embeddings": True,
    }


def gpt2_tensors(config: Gpt2StyleConfig) -> list[HfTensor]:
    """Every tensor of a GPT2LMHeadModel checkpoint (the head is tied to wte, so it is not stored)."""
    h = "transformer.h.{layer}."
    return [
        tensor("transformer.wte.weight", "token_embeddings.weight", "vocab", "embed"),
        tensor("transformer.wpe.weight", "position_embeddings.weight", "position", "embed"),
        tensor(h + "ln_1.weight", "ln_1.weight", "embed"),
        tensor(h + "ln_1.bias", "ln_1.bias", "embed"),
        fused(
            h + "attn.c_attn.weight",
            1,
            ("attn.q_proj.weight", ("embed", HEAD)),
            ("attn.k_proj.weight", ("embed", KV_HEAD)),
            ("attn.v_proj.weight", ("embed", KV_HEAD)),
        ),
        fused(
            h + "attn.c_attn.bias",
            0,
            ("attn.q_proj.bias", (HEAD,)),
            ("attn.k_proj.bias", (KV_HEAD,)),
            ("attn.v_proj.bias", (KV_HEAD,)),
        ),
        tensor(h + "attn.c_proj.weight", "attn.o_proj.weight", HEAD, "embed"),
        tensor(h + "attn.c_proj.bias", "attn.o_proj.bias", "embed"),
        tensor(h + "ln_2.weight", "ln_2.weight", "embed"),
        tensor(h + "ln_2.bias", "ln_2.bias", "embed"),
        tensor(h + "mlp.c_fc.weight", "mlp.up.weight", "embed", "mlp"),
        tensor(h + "mlp.c_fc.bias", "mlp.up.bias", "mlp"),
        tensor(h + "mlp.c_proj.weight", "mlp.down.weight", "mlp", "embed"),
        tensor(h + "mlp.c_proj.bias", "mlp.down.bias", "embed"),
        tensor("transformer.ln_f.weight", "ln_f.weight", "embed"),
        tensor("transformer.ln_f.bias", "ln_f.bias", "embed"),
    ]


Gpt2Config.hf_mapping = HfMapping(
    hf_model_type="gpt2",
    architecture="GPT2LMHeadModel",
    config_from_hf=gpt2_from_hf,
    config_to_hf=gpt2_to_hf,
    tensors=gpt2_tensors,
    base_prefix="transformer.",
    # The causal-mask buffers of old checkpoints, and the tied head that some of them store anyway.
    ignored_suffixes=(".attn.bias", ".attn.masked_bias", "lm_head.weight"),
    truncatable=frozenset({"position"}),
)
