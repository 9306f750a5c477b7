"""MPT: config.json (with its nested attn_config) <-> MptConfig, and the checkpoint layout (fused Wqkv)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lm_models import MptConfig

from ..errors import HfBridgeError
from ..layout import HfTensor, fused, tensor
from .base import Family
from .hf_keys import GENERIC_KEYS, HfConfigReader

HEAD = ("heads", "head_size")
# transformers' MptMLP and its ALiBi call hard-code these, whatever config.json says.
HF_EXPANSION_RATIO = 4
HF_ALIBI_BIAS_MAX = 8.0


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
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


def config_to_hf(config: MptConfig, vocab_size: int) -> dict[str, Any]:
    """An MPT config.json (the family's keys) for our config; only what transformers' MPT can represent."""
    if config.Mlp.size != HF_EXPANSION_RATIO * config.hidden_dim:
        raise HfBridgeError(
            f"MptConfig with an MLP of {config.Mlp.size} = {config.Mlp.size / config.hidden_dim:g} x hidden_dim "
            f"cannot be exported: transformers' MptForCausalLM always builds a {HF_EXPANSION_RATIO} x hidden_dim "
            "MLP. Use expansion_ratio=4 (and no intermediate_dim) to export to Hugging Face."
        )
    if config.alibi_bias_max != HF_ALIBI_BIAS_MAX:
        raise HfBridgeError(
            f"MptConfig(alibi_bias_max={config.alibi_bias_max}) cannot be exported: transformers' MptForCausalLM "
            f"always uses alibi_bias_max={HF_ALIBI_BIAS_MAX:g}. Use alibi_bias_max=8 to export to Hugging Face."
        )
    if config.activation_function != "gelu":
        raise HfBridgeError(
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


def tensors(config: MptConfig) -> list[HfTensor]:
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


MPT = Family(
    hf_model_type="mpt",
    our_type="mpt",
    architecture="MptForCausalLM",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=tensors,
    base_prefix="transformer.",
    ignored_suffixes=("lm_head.weight",),
)
