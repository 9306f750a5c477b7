"""Gemma 1, 2 and 3: GeGLU, embeddings scaled by sqrt(hidden_dim), (1 + weight) RMSNorms, tied embeddings;
Gemma 2 adds post-norms, soft-capping and alternating local (sliding) and global layers; Gemma 3 adds q/k norms
and a RoPE theta of its own for the local layers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import LmConfig, check_positive
from .decoder_config import DecoderConfig, DecoderSpec, layer_windows
from .decoder_hf import (
    FULL,
    LLAMA_NORMS,
    SANDWICH_NORMS,
    SLIDING,
    common_from_hf,
    common_to_hf,
    decoder_mapping,
    expect_falsy,
    layer_types_to_hf,
)
from .hf_config import HfConfigError, HfConfigReader, refuse, rope_from_hf, rope_section
from .rope import RopeConfig


@LmConfig.register_subclass("gemma")
@dataclass(frozen=True)
class GemmaConfig(DecoderConfig):
    """Gemma hyperparameters (defaults: gemma-2b); the keys are Levanter's `gemma` keys.

    The MLP is GeGLU (`activation_function` gelu_pytorch_tanh, the same function as gelu_new).
    """

    seq_len: int = 8192
    hidden_dim: int = 2048
    intermediate_dim: int = 16384
    num_layers: int = 18
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int | None = 256
    activation_function: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    use_bias: bool = False
    """Biases on the q, k, v and output projections of attention (transformers' attention_bias)."""

    def decoder_spec(self) -> DecoderSpec:
        """Pre-norm blocks with Gemma's norms and embedding scale."""
        return DecoderSpec(norm_offset=1.0, embed_scale=True, qkv_bias=self.use_bias, out_bias=self.use_bias)


@dataclass(frozen=True)
class _LocalGlobal(GemmaConfig):
    """Gemma 2/3's layer pattern: every `sliding_window_pattern`-th layer is global, the others local."""

    query_pre_attn_scalar: int = 256
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 (instead of head_dim ** -0.5)."""
    sliding_window: int | None = 4096
    """Positions each query of a local layer sees (itself included); null: local layers attend fully too."""
    sliding_window_pattern: int = 2
    """Every this-many-th layer is global, the others local (2: local, global, local, ...)."""
    attn_logit_softcapping: float | None = None
    """Attention scores become cap * tanh(score / cap) with this cap; null: no capping."""
    final_logit_softcapping: float | None = None
    """Output logits become cap * tanh(logit / cap) with this cap; null: no capping."""

    def __post_init__(self) -> None:
        check_positive(self, "sliding_window_pattern")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{type(self).__name__}.{name} must be positive (or null), got {value!r}")
        super().__post_init__()

    def is_local(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) uses the sliding window."""
        return (layer + 1) % self.sliding_window_pattern != 0

    def local_global_spec(self, **extra) -> DecoderSpec:
        sliding = [self.is_local(i) for i in range(self.num_layers)]
        return DecoderSpec(
            norm_offset=1.0,
            embed_scale=True,
            post_attn_norm=True,
            post_mlp_norm=True,
            qkv_bias=self.use_bias,
            out_bias=self.use_bias,
            attention_scale=float(self.query_pre_attn_scalar) ** -0.5,
            attn_logit_soft_cap=self.attn_logit_softcapping,
            final_logit_soft_cap=self.final_logit_softcapping,
            layer_windows=layer_windows(self.num_layers, self.sliding_window, sliding),
            **extra,
        )


@LmConfig.register_subclass("gemma2")
@dataclass(frozen=True)
class Gemma2Config(_LocalGlobal):
    """Gemma 2 hyperparameters (defaults: gemma-2-2b).

    Norms before and after attention and the MLP; scores scaled by query_pre_attn_scalar ** -0.5 and
    soft-capped at attn_logit_softcapping, logits at final_logit_softcapping; local (sliding_window) and
    global layers alternate, local first (sliding_window_pattern=2).
    """

    hidden_dim: int = 2304
    intermediate_dim: int = 9216
    num_layers: int = 26
    num_heads: int = 8
    num_kv_heads: int = 4
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0

    def decoder_spec(self) -> DecoderSpec:
        """Gemma 2's blocks."""
        return self.local_global_spec()


@LmConfig.register_subclass("gemma3")
@dataclass(frozen=True)
class Gemma3Config(_LocalGlobal):
    """Gemma 3 text hyperparameters (defaults: gemma-3-4b's text tower).

    Gemma 2's blocks with per-head q/k norms; five local layers then one global (sliding_window_pattern=6);
    global layers use `rope` (theta 1e6, with its scaling), local ones plain RoPE of theta rope_local_base_freq.
    No soft-capping by default.
    """

    seq_len: int = 131072
    hidden_dim: int = 2560
    intermediate_dim: int = 10240
    num_layers: int = 34
    num_heads: int = 8
    num_kv_heads: int = 4
    sliding_window: int | None = 1024
    sliding_window_pattern: int = 6
    rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=1e6))
    rope_local_base_freq: float = 10000.0
    """RoPE theta of the local (sliding-window) layers, which use plain RoPE; global layers use `rope`."""

    def decoder_spec(self) -> DecoderSpec:
        """Gemma 2's blocks with q/k norms and the local layers' own RoPE."""
        return self.local_global_spec(qk_norm="head", local_rope_theta=float(self.rope_local_base_freq))


def gemma_activation(r: HfConfigReader, key: str, other: str) -> str:
    """The activation transformers uses (`key`; a legacy "gelu" means the tanh GELU), checked against `other`,
    the key the other Gemma generation reads, which must agree when set."""
    activation = r.get(key, "gelu_pytorch_tanh")
    if activation == "gelu":  # transformers rewrites Gemma's legacy "gelu" to the tanh approximation
        activation = "gelu_pytorch_tanh"
    alias = r.get(other)
    if alias is not None and alias != activation and not (alias == "gelu" and activation == "gelu_pytorch_tanh"):
        raise r.fail(other, f"differs from {key}={activation!r}; transformers versions disagree on which to use")
    return activation


def gemma_common(r: HfConfigReader, key: str, other: str, *, rope: bool = True) -> dict[str, Any]:
    """The keys Gemma 1, 2 and 3 share (`rope`: read the rope keys too)."""
    activation = gemma_activation(r, key, other)
    kwargs = common_from_hf(r, activation_key=key, rope=rope)
    kwargs["activation_function"] = activation
    kwargs["tie_word_embeddings"] = r.get("tie_word_embeddings", True)
    kwargs["use_bias"] = bool(r.get("attention_bias", False))
    expect_falsy(r, "use_bidirectional_attention", "lm_models' Gemma is a causal LM")
    return kwargs


def gemma_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """GemmaConfig keyword arguments from a Gemma config.json."""
    r = HfConfigReader(hf, where)
    kwargs = gemma_common(r, "hidden_act", "hidden_activation")
    r.finish()
    return kwargs


def gemma_to_hf(config: GemmaConfig, vocab_size: int) -> dict[str, Any]:
    """A Gemma config.json (the family's keys) for our config."""
    return {**common_to_hf(config, vocab_size), "attention_bias": config.use_bias}


def sliding_window_pattern(r: HfConfigReader, num_layers: int, default: int) -> int:
    """Every how many layers one is global: from sliding_window_pattern, or found from layer_types."""
    given = r.get("sliding_window_pattern", r.get("_sliding_window_pattern"))
    types = r.get("layer_types")
    if types is None:
        return int(given or default)
    candidates = [int(given)] if given else range(1, num_layers + 2)
    for pattern in candidates:
        if list(types) == [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]:
            return pattern
    raise r.fail(
        "layer_types",
        "is not every-n-th-layer-global (lm_models' Gemma layer pattern"
        + (f", with sliding_window_pattern={given})" if given else ")")
        + "; converting would change the model",
    )


def local_global_from_hf(r: HfConfigReader, default_pattern: int, *, rope: bool = True) -> dict[str, Any]:
    """The keys Gemma 2 and 3 add to Gemma's (`rope`: read the rope keys too)."""
    kwargs = gemma_common(r, "hidden_activation", "hidden_act", rope=rope)
    # cache_implementation only picks transformers' KV-cache class for generation.
    r.ignore("cache_implementation")
    kwargs.update(
        query_pre_attn_scalar=r.get("query_pre_attn_scalar", 256),
        sliding_window=r.get("sliding_window"),
        sliding_window_pattern=sliding_window_pattern(r, kwargs["num_layers"], default_pattern),
        attn_logit_softcapping=r.get("attn_logit_softcapping"),
        final_logit_softcapping=r.get("final_logit_softcapping"),
    )
    return kwargs


def local_global_to_hf(config: Any, vocab_size: int) -> dict[str, Any]:
    """The Gemma 2/3 keys of a config.json for our config."""
    return {
        **common_to_hf(config, vocab_size, activation_key="hidden_activation"),
        "attention_bias": config.use_bias,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "sliding_window": config.sliding_window,
        "layer_types": layer_types_to_hf(config),
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
    }


def gemma2_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gemma2Config keyword arguments from a Gemma 2 config.json (without layer_types: alternating, local first)."""
    r = HfConfigReader(hf, where)
    kwargs = local_global_from_hf(r, 2)
    r.finish()
    return kwargs


def gemma2_to_hf(config: Gemma2Config, vocab_size: int) -> dict[str, Any]:
    """A Gemma 2 config.json (the family's keys) for our config."""
    return local_global_to_hf(config, vocab_size)


def gemma3_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Gemma3Config keyword arguments from a gemma3_text config.json (transformers 4's or 5's rope keys)."""
    r = HfConfigReader(hf, where)
    section, params = rope_section(r)
    if set(params) & {SLIDING, FULL}:  # transformers 5: one rope dict per layer type
        unknown = sorted(set(params) - {SLIDING, FULL})
        if unknown:
            raise HfConfigError(f"{where}: {section} has layer types {unknown} that Gemma 3 does not have.")
        glob = rope_from_hf(r, params.get(FULL) or {}, f"{section}.{FULL}")
        local = rope_from_hf(r, params.get(SLIDING) or {"rope_theta": 10000.0}, f"{section}.{SLIDING}")
    else:
        glob = rope_from_hf(r, {**params, "rope_theta": r.get("rope_theta", 1e6)}, section)
        local = rope_from_hf(r, {"rope_theta": r.get("rope_local_base_freq", 10000.0)}, "rope_local_base_freq")
    if local.type != "default":
        raise HfConfigError(
            f"{where}: the sliding layers' RoPE has type {local.type!r}; lm_models' Gemma 3 gives its local layers "
            "plain RoPE, and converting would change the model."
        )
    kwargs = local_global_from_hf(r, 6, rope=False)
    kwargs.update(rope=glob, rope_local_base_freq=local.theta)
    r.finish()
    return kwargs


def gemma3_to_hf(config: Gemma3Config, vocab_size: int) -> dict[str, Any]:
    """A gemma3_text config.json (the family's keys, in transformers 4's form, which 5 also reads)."""
    refuse(
        config.rope.type == "dynamic",
        "Gemma3Config with dynamic rope cannot be exported: transformers' max_position_embeddings would move.",
    )
    return {
        **local_global_to_hf(config, vocab_size),
        "rope_local_base_freq": config.rope_local_base_freq,
        "sliding_window_pattern": config.sliding_window_pattern,
    }


GemmaConfig.hf_mapping = decoder_mapping("gemma", "GemmaForCausalLM", gemma_from_hf, gemma_to_hf, LLAMA_NORMS)
Gemma2Config.hf_mapping = decoder_mapping("gemma2", "Gemma2ForCausalLM", gemma2_from_hf, gemma2_to_hf, SANDWICH_NORMS)
# The text-only `gemma3_text` model (Gemma3ForCausalLM); the multimodal `gemma3` checkpoints are not converted.
Gemma3Config.hf_mapping = decoder_mapping(
    "gemma3_text", "Gemma3ForCausalLM", gemma3_from_hf, gemma3_to_hf, SANDWICH_NORMS
)
