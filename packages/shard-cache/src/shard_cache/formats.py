"""The record formats by name (Levanter's `format` types): text, prompt_completion and chat."""

from __future__ import annotations

from tokenizers import Tokenizer

from shard_cache.chat import ChatProcessor
from shard_cache.processor import BatchProcessor, TokenizerProcessor
from shard_cache.records import PromptCompletionProcessor

RECORD_FORMATS = ("text", "prompt_completion", "chat")


def record_processor(
    record_format: str,
    tokenizer: Tokenizer | str,
    *,
    chat_template: str | None = None,
    mask_user_turns: bool = True,
    eos_token: str | None = None,
    bos_token: str | None = None,
    add_bos: bool = False,
) -> BatchProcessor:
    """The processor for one of RECORD_FORMATS: text (plain TokenizerProcessor), prompt_completion or chat."""
    if record_format == "text":
        return TokenizerProcessor(tokenizer, eos_token=eos_token, bos_token=bos_token, add_bos=add_bos)
    if record_format == "prompt_completion":
        return PromptCompletionProcessor(
            tokenizer, mask_prompt=mask_user_turns, eos_token=eos_token, bos_token=bos_token, add_bos=add_bos
        )
    if record_format == "chat":
        return ChatProcessor(tokenizer, chat_template=chat_template, mask_user_turns=mask_user_turns)
    raise ValueError(f"record format {record_format!r} is unknown; use one of {', '.join(RECORD_FORMATS)}.")
