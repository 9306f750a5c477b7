"""What the decoder families share in Hugging Face: the common config.json keys, `layer_types`, and the
checkpoint layout of DecoderLMHeadModel (each family's module adds its own keys and its HfMapping)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from named_tensors import ACTIVATION_NAMES

from .decoder_config import DecoderConfig
from .hf_config import HfConfigReader, max_positions_to_hf, rope_from_hf, rope_to_hf
from .hf_layout import HfMapping, HfTensor, split, tensor

HEAD = ("heads", "head_size")
KV_HEAD = ("kv_heads", "head_size")
SLIDING, FULL = "sliding_attention", "full_attention"
# Where our norms live in each family's checkpoint (Llama's post_attention_layernorm is the norm before the MLP).
LLAMA_NORMS = {"pre_attn_norm": "input_layernorm", "pre_mlp_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {
    "pre_attn_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "pre_mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def common_from_hf(r: HfConfigReader, *, activation_key: str = "hidden_act", rope: bool = True) -> dict[str, Any]:
    """DecoderConfig keyword arguments from the keys every Llama-like config.json has."""
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    activation = r.get(activation_key, "silu")
    if activation not in ACTIVATION_NAMES:
        raise r.fail(activation_key, f"is not an activation hf_bridge knows: {list(ACTIVATION_NAMES)}")
    partial = r.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise r.fail("partial_rotary_factor", "lm_models rotates the whole head")
    # pretraining_tp only splits matmuls into slices in transformers 4: the same math.
    r.ignore("pretraining_tp", "vocab_size")
    kwargs = {
        "seq_len": r.get("max_position_embeddings", 2048),
        "hidden_dim": hidden,
        "intermediate_dim": r.require("intermediate_size"),
        "num_layers": r.require("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": r.get("num_key_value_heads", heads),
        "head_dim": r.get("head_dim", hidden // heads),
        "activation_function": activation,
        "initializer_range": r.get("initializer_range", 0.02),
        "layer_norm_epsilon": r.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": r.get("tie_word_embeddings", False),
        "attn_pdrop": r.get("attention_dropout", 0.0),
    }
    if rope:
        kwargs["rope"] = rope_from_hf(r)
    return kwargs


def common_to_hf(config: DecoderConfig, vocab_size: int, *, activation_key: str = "hidden_act") -> dict[str, Any]:
    """The common keys of a Llama-like config.json for our config."""
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
        activation_key: config.activation_function,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": config.attn_pdrop,
        "rope_theta": theta,
        "rope_scaling": scaling,
    }


def check_layer_types(r: HfConfigReader, sliding: Sequence[bool], derived_from: str) -> None:
    """Raise unless config.json's `layer_types` (when present) are the ones our config's `derived_from` give."""
    given = r.get("layer_types")
    if given is None:
        return
    expected = [SLIDING if s else FULL for s in sliding]
    if list(given) != expected:
        raise r.fail(
            "layer_types",
            f"differs from the layer types that {derived_from} give ({expected}); lm_models cannot represent this "
            "layer pattern, and converting would change the model",
        )


def layer_types_to_hf(config: DecoderConfig) -> list[str]:
    """`layer_types` for our config: sliding_attention where a layer has a window."""
    windows = config.decoder_spec().layer_windows or (None,) * config.num_layers
    return [SLIDING if w is not None else FULL for w in windows]


def expect_falsy(r: HfConfigReader, key: str, why: str) -> None:
    """Raise when `key` is set to anything truthy."""
    if r.get(key):
        raise r.fail(key, f"is not supported: {why}")


def mixtral_experts(h: str, layers: tuple[int, ...] | None) -> list[HfTensor]:
    """Mixtral's mixture of experts in layer prefix `h`: block_sparse_moe.gate and one w1/w3/w2 per expert."""
    moe = h + "block_sparse_moe."
    return [
        tensor(moe + "gate.weight", "mlp.router.weight", "experts", "embed", layers=layers),
        split(moe + "experts.{expert}.w1.weight", "mlp.experts.gate", "experts", "mlp", "embed", layers=layers),
        split(moe + "experts.{expert}.w3.weight", "mlp.experts.up", "experts", "mlp", "embed", layers=layers),
        split(moe + "experts.{expert}.w2.weight", "mlp.experts.down", "experts", "embed", "mlp", layers=layers),
    ]


# (h, layers) -> the HF tensors of a mixture of experts in those layers.
ExpertTensors = Callable[[str, "tuple[int, ...] | None"], list[HfTensor]]


def decoder_tensors(
    config: DecoderConfig, norms: Mapping[str, str], experts: ExpertTensors = mixtral_experts, mlp_key: str = "mlp"
) -> list[HfTensor]:
    """Every tensor of a Llama-like checkpoint for our config; `norms` maps our norm names to the family's,
    `experts` gives the tensors of a mixture of experts (Mixtral's names by default), `mlp_key` names the dense
    MLP in a layer (Llama 4's feed_forward)."""
    spec = config.decoder_spec()
    h = "model.layers.{layer}."
    out = [tensor("model.embed_tokens.weight", "embed_tokens.weight", "vocab", "embed")]
    present = {
        "pre_attn_norm": spec.pre_attn_norm,
        "post_attn_norm": spec.post_attn_norm,
        "pre_mlp_norm": spec.pre_mlp_norm,
        "post_mlp_norm": spec.post_mlp_norm,
    }
    for ours, has in present.items():
        if has and spec.norm_weight:
            out.append(tensor(h + norms[ours] + ".weight", ours + ".weight", "embed"))
    for name, heads in (("q_proj", HEAD), ("k_proj", KV_HEAD), ("v_proj", KV_HEAD)):
        out.append(tensor(h + f"self_attn.{name}.weight", f"self_attn.{name}.weight", heads, "embed"))
        if spec.qkv_bias:
            out.append(tensor(h + f"self_attn.{name}.bias", f"self_attn.{name}.bias", heads))
    if spec.attention_sinks:
        out.append(tensor(h + "self_attn.sinks", "self_attn.sinks", "heads"))
    out.append(tensor(h + "self_attn.o_proj.weight", "self_attn.o_proj.weight", "embed", HEAD))
    if spec.out_bias:
        out.append(tensor(h + "self_attn.o_proj.bias", "self_attn.o_proj.bias", "embed"))
    if spec.qk_norm is not None:
        q_axes, k_axes = (("head_size",), ("head_size",)) if spec.qk_norm == "head" else ((HEAD,), (KV_HEAD,))
        out.append(tensor(h + "self_attn.q_norm.weight", "self_attn.q_norm.weight", *q_axes))
        out.append(tensor(h + "self_attn.k_norm.weight", "self_attn.k_norm.weight", *k_axes))
    sparse = [spec.is_sparse(i) for i in range(config.num_layers)]
    # In a mixed model each kind of MLP has its tensors in its own layers only.
    dense_layers = tuple(i for i, s in enumerate(sparse) if not s) if any(sparse) and not all(sparse) else None
    sparse_layers = tuple(i for i, s in enumerate(sparse) if s) if dense_layers is not None else None
    if not all(sparse):
        for hf_name, ours, layout in (
            ("gate_proj", "gate", ("mlp", "embed")),
            ("up_proj", "up", ("mlp", "embed")),
            ("down_proj", "down", ("embed", "mlp")),
        ):
            out.append(tensor(h + f"{mlp_key}.{hf_name}.weight", f"mlp.{ours}.weight", *layout, layers=dense_layers))
            if spec.mlp_bias:
                out.append(tensor(h + f"{mlp_key}.{hf_name}.bias", f"mlp.{ours}.bias", layout[0], layers=dense_layers))
    if any(sparse):
        out += experts(h, sparse_layers)
    if spec.norm_weight:
        out.append(tensor("model.norm.weight", "norm.weight", "embed"))
    if not config.tie_word_embeddings:
        out.append(tensor("lm_head.weight", "lm_head.weight", "vocab", "embed"))
    return out


def decoder_mapping(
    hf_model_type: str,
    architecture: str,
    config_from_hf,
    config_to_hf,
    norms,
    experts: ExpertTensors = mixtral_experts,
    mlp_key: str = "mlp",
) -> HfMapping:
    """The HfMapping of a decoder family whose checkpoint follows decoder_tensors."""
    return HfMapping(
        hf_model_type=hf_model_type,
        architecture=architecture,
        config_from_hf=config_from_hf,
        config_to_hf=config_to_hf,
        tensors=lambda config: decoder_tensors(config, norms, experts, mlp_key),
        base_prefix="model.",
        ignored_suffixes=(".rotary_emb.inv_freq",),
    )
