"""Llama: config.json <-> LlamaConfig (GQA, rope scaling, tied or untied head), and the checkpoint layout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import LlamaConfig
from named_tensors.nn.activations import ACTIVATION_NAMES

from ..errors import HfBridgeError
from ..layout import HfTensor, tensor
from .base import Family
from .hf_keys import HfConfigReader
from .rope import ROPE_KEYS, max_positions_to_hf, rope_from_hf, rope_to_hf

__all__ = ["LLAMA", "ROPE_KEYS", "config_from_hf", "config_to_hf", "rope_from_hf", "rope_to_hf", "tensors"]

HEAD = ("heads", "head_size")
KV_HEAD = ("kv_heads", "head_size")


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
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


def config_to_hf(config: LlamaConfig, vocab_size: int) -> dict[str, Any]:
    """A Llama config.json (the family's keys) for our config."""
    if not config.use_layer_norm_weight:
        raise HfBridgeError(
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


def tensors(config: LlamaConfig) -> list[HfTensor]:
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


LLAMA = Family(
    hf_model_type="llama",
    our_type="llama",
    architecture="LlamaForCausalLM",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=tensors,
    base_prefix="model.",
    ignored_suffixes=(".rotary_emb.inv_freq",),
)
