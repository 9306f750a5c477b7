"""Preference pairs for DPO: the records (a prompt with a chosen and a rejected response) and their processors.

Two record forms, following TRL's and Levanter's preference datasets:
- `preference` (text): `prompt`, `chosen` and `rejected` strings. Each sequence is prompt + response as given
  (no separator is added), then EOS; the target is the response and the EOS.
- `preference_chat`: `chosen` and `rejected` are message lists (or one message, or a string: the assistant's
  content), appended to the prompt's messages in `prompt` or `messages`; without either, they are whole
  conversations and the prompt is the messages they share at the start (Levanter's `preference_chat`). Each
  conversation is rendered with the chat template (ids as `apply_chat_template` gives them); the target is the
  assistant text of the response turns (from `{% generation %}` tags, or found by incremental rendering as
  `ChatProcessor` does), never the prompt's turns.

One cache row per pair, so that the reader's machinery (ledger, token counts, waiting) is the usual one:
`input_ids` holds the chosen sequence followed by the rejected one, `loss_mask` their targets (token
convention: True where the token is a target) and `is_rejected` marks the rejected sequence's tokens. Plain
pyarrow splits a row with `is_rejected`. `shard_cache.preferences` reads them back as pairs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from shard_cache.chat import ASSISTANT, ChatProcessor
from shard_cache.processor import TokenizerProcessor
from shard_cache.records import (
    LOSS_MASK,
    BadRecord,
    LossSpans,
    SpanRecordProcessor,
    SpanTokenizer,
    list_column,
    string_field,
)

IS_REJECTED = "is_rejected"
PREFERENCE_FORMATS = ("preference", "preference_chat")
PAIR_FIELDS = ("input_ids", "loss_mask", "rejected_input_ids", "rejected_loss_mask")
"""The arrays of a batch of pairs: the chosen sequence (`input_ids`, `loss_mask`) and the rejected one."""


@dataclass(frozen=True)
class PreparedPair:
    """A record ready to tokenize: the chosen and the rejected sequence, each with its target spans."""

    chosen: LossSpans
    rejected: LossSpans


def _list_rows(column: pa.ListArray) -> list[np.ndarray]:
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(column))]


def _pair_batch(tokenize: SpanTokenizer, pairs: Sequence[PreparedPair]) -> pa.RecordBatch:
    """One row per pair: input_ids and loss_mask of chosen then rejected, and is_rejected."""
    chosen = tokenize([p.chosen for p in pairs])
    rejected = tokenize([p.rejected for p in pairs])
    c_ids, c_masks = _list_rows(chosen.column(0)), _list_rows(chosen.column(1))
    r_ids, r_masks = _list_rows(rejected.column(0)), _list_rows(rejected.column(1))
    ids = [np.concatenate([c, r]) for c, r in zip(c_ids, r_ids, strict=True)]
    masks = [np.concatenate([c, r]) for c, r in zip(c_masks, r_masks, strict=True)]
    sides = [np.concatenate([np.zeros(len(c), bool), np.ones(len(r), bool)]) for c, r in zip(c_ids, r_ids, strict=True)]
    columns = [
        list_column(ids, np.int32, pa.int32()),
        list_column(masks, bool, pa.bool_()),
        list_column(sides, bool, pa.bool_()),
    ]
    return pa.RecordBatch.from_arrays(columns, names=["input_ids", LOSS_MASK, IS_REJECTED])


class PreferenceProcessor(SpanRecordProcessor):
    """`prompt` + `chosen` + `rejected` string records: two sequences per record, the responses (and EOS) as targets."""

    kind = "preference"

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        *,
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        eos_token: str | None = None,
        bos_token: str | None = None,
        add_bos: bool = False,
    ):
        fields = (prompt_field, chosen_field, rejected_field)
        super().__init__(tokenizer, fields, eos_token=eos_token, bos_token=bos_token, add_bos=add_bos)
        self.prompt_field, self.chosen_field, self.rejected_field = fields

    def prepare(self, record: Mapping[str, Any]) -> PreparedPair:
        """The two sequences of a record and their target spans (the responses)."""
        prompt = string_field(record, self.prompt_field)
        chosen = string_field(record, self.chosen_field, allow_empty=False)
        rejected = string_field(record, self.rejected_field, allow_empty=False)
        if chosen == rejected:
            raise BadRecord(
                "no_distinct_response",
                f"fields {self.chosen_field!r} and {self.rejected_field!r} hold the same response, so the pair "
                "prefers nothing; drop the record or give it a rejected response that differs",
            )
        start = len(prompt)
        return PreparedPair(
            LossSpans(prompt + chosen, ((start, start + len(chosen)),)),
            LossSpans(prompt + rejected, ((start, start + len(rejected)),)),
        )

    def __call__(self, pairs: list[PreparedPair]) -> pa.RecordBatch:
        """input_ids, loss_mask and is_rejected of each prepared pair."""
        return _pair_batch(self._tokenize, pairs)


class PreferenceChatProcessor:
    """Chat preference records: the prompt's messages, then the chosen or the rejected turns, rendered by a template.

    `tokenizer`, `chat_template`, `roles`, `special_tokens`, `template_variables` and `now` are ChatProcessor's.
    `prompt_fields` are tried in order for the prompt's messages; none present means an implicit prompt.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        *,
        chat_template: str | None = None,
        prompt_fields: Sequence[str] = ("prompt", "messages"),
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        **chat_options: Any,
    ):
        self.chat = ChatProcessor(tokenizer, chat_template=chat_template, **chat_options)
        self.tokenizer = self.chat.tokenizer
        self.prompt_fields = tuple(prompt_fields)
        self.chosen_field, self.rejected_field = chosen_field, rejected_field
        self.record_fields = (*self.prompt_fields, chosen_field, rejected_field)
        self._tokenize = SpanTokenizer(self.tokenizer)

    def fingerprint(self) -> dict[str, Any]:
        """Settings that determine the output."""
        chat = {k: v for k, v in self.chat.fingerprint().items() if k not in ("kind", "messages_field")}
        return {"kind": "preference_chat", **chat, "fields": list(self.record_fields)}

    def _turns(self, record: Mapping[str, Any], name: str) -> list[Any]:
        if name not in record or record[name] is None:
            keys = ", ".join(sorted(map(str, record))[:10])
            raise BadRecord("missing_field", f"no field {name!r} (the record has: {keys})")
        value = record[name]
        if isinstance(value, str):
            return [{"role": ASSISTANT, "content": value}]
        if isinstance(value, dict):
            return [value]
        if isinstance(value, list) and value:
            return list(value)
        raise BadRecord("bad_messages", f"field {name!r} must be a message, a list of messages or a string")

    def _split(self, record: Mapping[str, Any]) -> tuple[list[Any], list[Any], list[Any]]:
        """(prompt messages, chosen turns, rejected turns), as given or with the shared prefix as the prompt."""
        chosen, rejected = self._turns(record, self.chosen_field), self._turns(record, self.rejected_field)
        given = [f for f in self.prompt_fields if record.get(f) is not None]
        if len(given) > 1:
            raise BadRecord("ambiguous_prompt", f"fields {given} both hold a prompt; give one of them")
        if given:
            prompt = record[given[0]]
            if not isinstance(prompt, list):
                raise BadRecord("bad_messages", f"field {given[0]!r} must be a list of messages")
            if chosen == rejected:
                raise BadRecord(
                    "no_distinct_response",
                    f"fields {self.chosen_field!r} and {self.rejected_field!r} hold the same response, so the pair "
                    "prefers nothing; drop the record or give it a rejected response that differs",
                )
            return list(prompt), chosen, rejected
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == len(chosen) or shared == len(rejected):
            raise BadRecord(
                "no_distinct_response",
                "the chosen and rejected conversations do not differ after their shared messages, so there is no "
                "response to compare",
            )
        return chosen[:shared], chosen[shared:], rejected[shared:]

    def _sequence(self, prompt: list[Any], turns: list[Any], side: str) -> LossSpans:
        messages = self.chat.messages({self.chat.messages_field: prompt + turns})
        if not any(m["role"] == ASSISTANT for m in messages[len(prompt) :]):
            raise BadRecord("no_assistant_turn", f"the {side} response has no assistant message")
        text, marked = self.chat.render(messages)
        head, _ = self.chat.render(messages[: len(prompt)], add_generation_prompt=True) if prompt else ("", None)
        if not text.startswith(head):
            raise BadRecord(
                "template_not_incremental",
                f"under this chat template the prompt, rendered with the generation prompt, is not the start of the "
                f"{side} conversation, so its response cannot be located",
            )
        if self.chat.template.marks_generation:
            spans = [(s, e) for s, e in marked if s >= len(head)]
        else:
            spans = self._incremental_spans(messages, len(prompt), text)
        if not spans:
            raise BadRecord("no_assistant_turn", f"the {side} response renders to no assistant text")
        return LossSpans(text, tuple(spans))

    def _incremental_spans(self, messages: list[dict], first: int, full: str) -> list[tuple[int, int]]:
        """Spans of the assistant messages from index `first` on, as ChatProcessor finds them without tags."""
        spans = []
        for i in range(first, len(messages)):
            if messages[i]["role"] != ASSISTANT:
                continue
            before, _ = self.chat.render(messages[:i], add_generation_prompt=True)
            turn, _ = self.chat.render(messages[: i + 1])
            if not (turn.startswith(before) and full.startswith(turn)):
                raise BadRecord(
                    "template_not_incremental",
                    "under this chat template a conversation's renderings are not prefixes of each other, so the "
                    "response cannot be located. Mark the assistant text with {% generation %}...{% endgeneration %}",
                )
            end = max(len(turn.rstrip()), len(before))
            if end > len(before):
                spans.append((len(before), end))
        return spans

    def prepare(self, record: Mapping[str, Any]) -> PreparedPair:
        """Both rendered conversations and their target spans (the response's assistant text)."""
        prompt, chosen, rejected = self._split(record)
        return PreparedPair(self._sequence(prompt, chosen, "chosen"), self._sequence(prompt, rejected, "rejected"))

    def __call__(self, pairs: list[PreparedPair]) -> pa.RecordBatch:
        """input_ids, loss_mask and is_rejected of each prepared pair (ids as apply_chat_template gives them)."""
        return _pair_batch(self._tokenize, pairs)


def preference_processor(
    record_format: str, tokenizer: Tokenizer | str, *, chat_template: str | None = None, **options: Any
) -> PreferenceProcessor | PreferenceChatProcessor:
    """The processor of one of PREFERENCE_FORMATS."""
    if record_format == "preference":
        return PreferenceProcessor(tokenizer, **options)
    if record_format == "preference_chat":
        return PreferenceChatProcessor(tokenizer, chat_template=chat_template, **options)
    raise ValueError(f"preference format {record_format!r} is unknown; use one of {', '.join(PREFERENCE_FORMATS)}.")


def processor_from_fingerprint(
    wanted: Mapping[str, Any], tokenizer: Tokenizer | str, chat_template: str | None = None
) -> PreferenceProcessor | PreferenceChatProcessor:
    """The preference processor that a cache's fingerprint describes, made from its tokenizer (for repairs)."""
    *prompt_fields, chosen_field, rejected_field = wanted["fields"]
    if wanted["kind"] == "preference":
        loaded = TokenizerProcessor(tokenizer).tokenizer
        eos = loaded.id_to_token(wanted["eos_id"]) if wanted.get("eos_id") is not None else None
        bos = loaded.id_to_token(wanted["bos_id"]) if wanted.get("bos_id") is not None else None
        (prompt_field,) = prompt_fields
        return PreferenceProcessor(
            loaded,
            prompt_field=prompt_field,
            chosen_field=chosen_field,
            rejected_field=rejected_field,
            eos_token=eos,
            bos_token=bos,
            add_bos=bos is not None,
        )
    from datetime import datetime

    return PreferenceChatProcessor(
        tokenizer,
        chat_template=chat_template,
        prompt_fields=prompt_fields,
        chosen_field=chosen_field,
        rejected_field=rejected_field,
        mask_user_turns=wanted["mask_user_turns"],
        roles=wanted["roles"],
        special_tokens=wanted["special_tokens"],
        template_variables=wanted["template_variables"],
        now=datetime.fromisoformat(wanted["now"]) if "now" in wanted else None,
    )


__all__ = [
    "IS_REJECTED",
    "PAIR_FIELDS",
    "PREFERENCE_FORMATS",
    "PreferenceChatProcessor",
    "PreferenceProcessor",
    "PreparedPair",
    "preference_processor",
    "processor_from_fingerprint",
]
