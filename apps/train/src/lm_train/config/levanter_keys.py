"""Levanter keys and values that lm-train does not take, each with what to write instead.

A Levanter config then fails on its first such key with a message that names the replacement, rather than
with "unknown key".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_UPLOAD = (
    "lm-train makes no uploads to the Hugging Face hub: write the export with {save} and upload that directory "
    "yourself (e.g. `huggingface-cli upload`)."
)

KEY_HINTS: dict[tuple[str, ...], str] = {
    ("dataset_type",): "give the records' format as `data.format: {type: chat}` (or prompt_completion, supervised, "
    "text) and their files as `data.train_urls`.",
    ("chat_template",): "give it as `data.format.chat_template` (with `data.format: {type: chat}`); without it "
    "the tokenizer's tokenizer_config.json `chat_template` is used.",
    ("chat_train_urls",): "use `data.train_urls`, with `data.format: {type: chat}`.",
    ("supervised_data",): "describe the data in the `data` section: `data.train_urls`, `data.validation_urls`, "
    "`data.cache_dir` and `data.format`.",
    ("max_seq_len",): "use `model.seq_len`, the length trained on (longer conversations are cut as "
    "`data.long_documents` says).",
    ("max_train_length",): "use `model.seq_len`, the length trained on.",
    ("tokenizer",): "use `data.tokenizer`: a local tokenizer.json or Hugging Face tokenizer directory.",
    ("model_name_or_path",): "set `initialize_from_hf` to the model's local Hugging Face directory (lm-train "
    "downloads nothing from the hub).",
    ("epoch",): "use `trainer.num_train_steps`: the data repeats (epochs wrap around) for as many steps as it asks.",
    ("data_seed",): "use `trainer.seed`, which sets every random draw and the data order.",
    ("trust_remote_code",): "lm-train loads its built-in model families only, never remote code: remove the key.",
    ("peft_hf_upload",): _UPLOAD.format(save="`peft_save_path`"),
    ("merged_hf_upload",): _UPLOAD.format(save="`merged_hf_save_path`"),
    ("hf_upload",): _UPLOAD.format(save="`hf_save_path`"),
    ("data", "format", "system_prompt"): "put the system message first in each record's `messages`.",
    ("data", "format", "chat_template_kwargs"): "per-record template arguments are not read: write the "
    "variables into the template (`data.format.chat_template`).",
    ("data", "format", "single_turn"): "every conversation is read whole: remove the key.",
}


def _is_minus_one(value: Any) -> bool:
    return value == -1 and not isinstance(value, bool)


VALUE_HINTS: dict[tuple[str, ...], tuple[Callable[[Any], bool], str]] = {
    ("trainer", "train_batch_size"): (
        _is_minus_one,
        "-1 (Levanter: per_device_parallelism x the number of devices) is not taken: give the global batch "
        "size, e.g. trainer.per_device_parallelism times the number of devices.",
    ),
}


def key_hint(path: Sequence[str]) -> str | None:
    """What to use instead of a Levanter key lm-train does not take (None: not one of them)."""
    return KEY_HINTS.get(tuple(path))


def value_hint(path: Sequence[str], value: Any) -> str | None:
    """What to write instead of a Levanter value lm-train does not take at this key (None: fine)."""
    rule = VALUE_HINTS.get(tuple(path))
    if rule is not None and rule[0](value):
        return rule[1]
    return None
