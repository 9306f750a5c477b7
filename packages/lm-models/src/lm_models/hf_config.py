"""Reading and writing a family's config.json keys: a reader that accounts for every key, and RoPE's keys.

Plain data and checks (no file access): hf_bridge reads the file and hands the dict to a family's mapping.
transformers < 5 writes `rope_theta` plus a `rope_scaling` dict (with `rope_type` or the older `type`);
transformers 5 writes one `rope_parameters` dict that holds rope_theta too (and, for Gemma 3, one such dict per
layer type). Both are read; the export writes rope_theta and rope_scaling, which every version reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .rope import RopeConfig


class HfConfigError(ValueError):
    """A config.json (or a config to export) that a family's mapping cannot represent; names the key and the fix."""


def refuse(condition: bool, message: str) -> None:
    """Raise an export error (HfConfigError with `message`) when `condition` holds."""
    if condition:
        raise HfConfigError(message)


# Keys every transformers config may carry that do not change a causal LM's weights or its outputs:
# bookkeeping, token ids (kept by the tokenizer), and generation defaults (generation_config.json's job).
GENERIC_KEYS = frozenset(
    {
        "_name_or_path", "_commit_hash", "_attn_implementation", "_attn_implementation_autoset",
        "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
        "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "task_specific_params",
        "is_encoder_decoder", "is_decoder", "chunk_size_feed_forward", "output_attentions",
        "output_hidden_states", "return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss",
        "pruned_heads", "tie_encoder_decoder", "use_cache", "output_past", "gradient_checkpointing",
        "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
        "tokenizer_class", "prefix", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
        "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
        "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
        "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
        "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        "cross_attention_hidden_size", "keys_to_ignore_at_inference", "model_max_length",
    }
)  # fmt: skip


class HfConfigReader:
    """Reads keys of one config.json (or a nested section); `finish` fails on any key nobody read."""

    def __init__(self, hf: Mapping[str, Any], where: str, *, generic: frozenset[str] = GENERIC_KEYS) -> None:
        self.hf = dict(hf)
        self.where = where
        self.generic = generic
        self.seen: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key`, or `default` when it is absent or null."""
        self.seen.add(key)
        value = self.hf.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        """The value of `key`; an error naming the file when it is missing."""
        self.seen.add(key)
        if self.hf.get(key) is None:
            raise HfConfigError(f"{self.where} has no {key!r}, which hf_bridge needs; add it to the config.")
        return self.hf[key]

    def expect(self, key: str, default: Any, allowed: tuple[Any, ...], why: str) -> Any:
        """The value of `key` (default when absent), which must be one of `allowed`; `why` explains the limit."""
        value = self.get(key, default)
        if value not in allowed:
            raise HfConfigError(
                f"{self.where}: {key}={value!r} is not supported ({why}); supported values: {list(allowed)}."
            )
        return value

    def ignore(self, *keys: str) -> None:
        """Mark keys that do not change the model's weights or outputs."""
        self.seen.update(keys)

    def fail(self, key: str, message: str) -> HfConfigError:
        """An error about one key of this config."""
        return HfConfigError(f"{self.where}: {key}={self.hf.get(key)!r}: {message}")

    def finish(self) -> None:
        """Raise on the first key that was neither read nor known to be irrelevant (never drop it silently)."""
        unknown = sorted(k for k in self.hf if k not in self.seen and k not in self.generic)
        if unknown:
            raise HfConfigError(
                f"{self.where} has the key {unknown[0]!r} (unknown keys: {unknown}), which hf_bridge does not "
                "support, so converting would silently change the model. Remove the key if it has no effect, "
                "or use a checkpoint without it."
            )


# The keys each rope type reads besides its type and theta: (required, optional).
ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
    ),
}


def rope_section(r: HfConfigReader) -> tuple[str, dict[str, Any]]:
    """The name and contents of the config's rope dict (rope_parameters, else rope_scaling, else empty)."""
    section = "rope_parameters" if r.hf.get("rope_parameters") is not None else "rope_scaling"
    params = r.get(section, {})
    r.ignore("rope_parameters", "rope_scaling")
    if not isinstance(params, Mapping):
        raise HfConfigError(f"{r.where}: {section} must be a JSON object (or null), got {params!r}.")
    return section, dict(params)


def rope_from_hf(r: HfConfigReader, params: Mapping[str, Any] | None = None, where: str | None = None) -> RopeConfig:
    """RopeConfig from the config's rope dict (or `params`, one layer type's dict) and rope_theta."""
    if params is None:
        section, params = rope_section(r)
    else:
        section = where or "rope_parameters"
    params = dict(params)
    theta = params.pop("rope_theta", None)
    top_theta = r.get("rope_theta")
    if theta is None:
        theta = 10000.0 if top_theta is None else top_theta
    elif top_theta is not None and where is None and float(top_theta) != float(theta):
        raise r.fail("rope_theta", f"differs from {section}.rope_theta={theta}; keep one value")
    kind = params.pop("rope_type", None)
    legacy_kind = params.pop("type", None)
    kind = kind or legacy_kind or "default"
    if kind not in ROPE_KEYS:
        raise HfConfigError(
            f"{r.where}: {section} has rope type {kind!r}, which hf_bridge does not support (lm_models implements "
            f"{list(ROPE_KEYS)}), and converting without it would change the model's outputs. Use a checkpoint "
            "whose rope type is one of those."
        )
    required, optional = ROPE_KEYS[kind]
    missing = [k for k in required if params.get(k) is None]
    extra = sorted(k for k in params if k not in required + optional and params[k] is not None)
    if missing:
        raise HfConfigError(f"{r.where}: {section} of type {kind!r} lacks {missing}; add them.")
    if extra:
        raise HfConfigError(
            f"{r.where}: {section} of type {kind!r} has keys {extra} that lm_models' rope does not implement; "
            "converting would silently change the model."
        )
    fields = {k: params[k] for k in required + optional if params.get(k) is not None}
    if kind == "dynamic":
        # Dynamic NTK scales past the model's max_position_embeddings.
        fields["original_max_position_embeddings"] = int(r.get("max_position_embeddings", 2048))
    try:
        return RopeConfig(type=kind, theta=float(theta), **fields)
    except (TypeError, ValueError) as e:
        raise HfConfigError(f"{r.where}: {section} is not valid: {e}") from None


def rope_to_hf(rope: RopeConfig) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and a rope_scaling dict (None for plain RoPE), readable by transformers 4 and 5."""
    if rope.type == "default":
        return rope.theta, None
    scaling: dict[str, Any] = {"rope_type": rope.type, "type": rope.type, "factor": rope.factor}
    if rope.type == "llama3":
        scaling.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    if rope.type == "yarn":
        scaling.update(
            original_max_position_embeddings=rope.original_max_position_embeddings,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            truncate=rope.truncate,
        )
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(rope, name) is not None:
                scaling[name] = getattr(rope, name)
    return rope.theta, scaling


def max_positions_to_hf(seq_len: int, rope: RopeConfig) -> int:
    """config.json's max_position_embeddings: seq_len, or where dynamic NTK scaling starts (which it sets)."""
    return rope.original_max_position_embeddings if rope.type == "dynamic" else seq_len
