"""Reading an HF config.json so that every key is either used, checked, or known to be irrelevant."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import HfBridgeError

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
            raise HfBridgeError(f"{self.where} has no {key!r}, which hf_bridge needs; add it to the config.")
        return self.hf[key]

    def expect(self, key: str, default: Any, allowed: tuple[Any, ...], why: str) -> Any:
        """The value of `key` (default when absent), which must be one of `allowed`; `why` explains the limit."""
        value = self.get(key, default)
        if value not in allowed:
            raise HfBridgeError(
                f"{self.where}: {key}={value!r} is not supported ({why}); supported values: {list(allowed)}."
            )
        return value

    def ignore(self, *keys: str) -> None:
        """Mark keys that do not change the model's weights or outputs."""
        self.seen.update(keys)

    def fail(self, key: str, message: str) -> HfBridgeError:
        """An error about one key of this config."""
        return HfBridgeError(f"{self.where}: {key}={self.hf.get(key)!r}: {message}")

    def finish(self) -> None:
        """Raise on the first key that was neither read nor known to be irrelevant (never drop it silently)."""
        unknown = sorted(k for k in self.hf if k not in self.seen and k not in self.generic)
        if unknown:
            raise HfBridgeError(
                f"{self.where} has the key {unknown[0]!r} (unknown keys: {unknown}), which hf_bridge does not "
                "support, so converting would silently change the model. Remove the key if it has no effect, "
                "or use a checkpoint without it."
            )
