"""Chat records (OpenAI role/content `messages`) rendered with the model's chat template, with assistant-only loss.

The token ids are those of transformers' `apply_chat_template(messages)` (render, then tokenize the whole text
without adding special tokens). With `mask_user_turns` (the default) the loss covers the assistant's turns only.

How the assistant spans are found:
- a template that marks them with `{% generation %} ... {% endgeneration %}` defines them itself: the marked
  text is the span, exactly what transformers' `return_assistant_tokens_mask` uses;
- otherwise by rendering incrementally: for assistant message i, the span runs from the end of
  render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i + 1]), less trailing
  whitespace. So the assistant header is not a target, and the end-of-turn token is (the model learns to stop).
  That needs a template under which each rendering is a prefix of the next; a record for which it is not
  (e.g. a template that drops earlier turns' reasoning) is a bad record whose message says to add the tags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import pyarrow as pa
from tokenizers import Tokenizer

from shard_cache.chat_template import (
    MARKERS,
    CompiledTemplate,
    resolve_template,
    special_tokens_of,
    template_sha256,
    tokenizer_config,
)
from shard_cache.processor import load_tokenizer
from shard_cache.records import BadRecord, LossSpans, SpanTokenizer, tokenizer_sha256

DEFAULT_ROLES = ("system", "developer", "user", "assistant", "tool")
ASSISTANT = "assistant"
# What `strftime_now` shows by default: a fixed instant, so that a build gives the same bytes on any day and
# resumes on another day (transformers uses the clock). Pass `now=` to ChatProcessor to choose another.
DEFAULT_NOW = datetime(2024, 7, 26)
# transformers copies a message's reasoning, given under any of these names, to `thinking` and
# `reasoning_content` (the names templates read); done here too so that the renderings agree.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _is_directory(path: str) -> bool:
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    return fs.isdir(fs_path)


def _holds_marker(value: Any) -> bool:
    if isinstance(value, str):
        return any(m in value for m in MARKERS)
    if isinstance(value, Mapping):
        return any(_holds_marker(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_marker(v) for v in value)
    return False


class ChatProcessor:
    """Renders `messages` records with a chat template and tokenizes them, storing `input_ids` and `loss_mask`.

    `tokenizer`: an HF tokenizer directory (its tokenizer.json, chat template and special tokens are used) or
    a tokenizer.json path / `tokenizers.Tokenizer` (then pass `chat_template` and `special_tokens`).
    `chat_template`: a jinja template string, or the name of one of the directory's templates.
    `roles`: the roles a message may have; another role is a bad record.
    `template_variables`: extra variables for the template (JSON values), like apply_chat_template's kwargs.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        *,
        chat_template: str | None = None,
        messages_field: str = "messages",
        mask_user_turns: bool = True,
        roles: Sequence[str] = DEFAULT_ROLES,
        special_tokens: Mapping[str, str] | None = None,
        template_variables: Mapping[str, Any] | None = None,
        now: datetime | None = None,
    ):
        directory = tokenizer if isinstance(tokenizer, str) and _is_directory(tokenizer) else None
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        source = resolve_template(directory, chat_template)
        where = f"the chat template of {directory}" if directory and chat_template is None else "the chat template"
        self.template = CompiledTemplate(source, now or DEFAULT_NOW, where)
        config = tokenizer_config(directory) if directory else {}
        self.special_tokens = dict(special_tokens_of(config) if special_tokens is None else special_tokens)
        self.template_variables = dict(template_variables or {})
        self.messages_field = messages_field
        self.mask_user_turns = mask_user_turns
        self.roles = tuple(roles)
        self.record_fields = (messages_field,)
        self._tokenize = SpanTokenizer(self.tokenizer)
        self._tokenizer_sha256 = tokenizer_sha256(self.tokenizer)

    @property
    def span_method(self) -> str:
        """How assistant spans are found: "generation_tags" or "incremental" (see the module docstring)."""
        return "generation_tags" if self.template.marks_generation else "incremental"

    def fingerprint(self) -> dict[str, Any]:
        """Settings that determine the output."""
        fingerprint = {
            "kind": "chat",
            "tokenizer_sha256": self._tokenizer_sha256,
            "template_sha256": template_sha256(self.template.source),
            "special_tokens": dict(sorted(self.special_tokens.items())),
            "template_variables": json.loads(json.dumps(self.template_variables, sort_keys=True)),
            "messages_field": self.messages_field,
            "mask_user_turns": self.mask_user_turns,
            "roles": list(self.roles),
            "spans": self.span_method,
        }
        if "strftime_now" in self.template.source:
            fingerprint["now"] = self.template.now.isoformat()
        return fingerprint

    def messages(self, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The record's messages, checked and normalised as transformers normalises them (None values dropped)."""
        messages = record.get(self.messages_field)
        if messages is None:
            keys = ", ".join(sorted(map(str, record))[:10])
            raise BadRecord("missing_field", f"no field {self.messages_field!r} (the record has: {keys})")
        if not isinstance(messages, list) or not messages:
            raise BadRecord("bad_messages", f"field {self.messages_field!r} must be a non-empty list of messages")
        clean = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise BadRecord("bad_message", f"message {i} is a {type(message).__name__}, not an object")
            message = {k: v for k, v in message.items() if v is not None}
            role = message.get("role")
            if role is None:
                raise BadRecord("missing_role", f"message {i} has no 'role' (it has: {', '.join(sorted(message))})")
            if role not in self.roles:
                raise BadRecord(
                    "unknown_role",
                    f"message {i} has the role {role!r}, which is not one of {list(self.roles)} (pass roles= to "
                    "allow it)",
                )
            if "content" not in message and not message.get("tool_calls"):
                raise BadRecord("missing_content", f"message {i} ({role}) has no 'content'")
            if not isinstance(message.get("content", ""), str | list):
                kind = type(message["content"]).__name__
                raise BadRecord("bad_content", f"message {i} ({role}) has a {kind} content, not text or a list")
            if _holds_marker(message):
                raise BadRecord("reserved_character", f"message {i} holds U+E000 or U+E001, which mark spans here")
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            clean.append(message)
        if self.mask_user_turns and not any(m["role"] == ASSISTANT for m in clean):
            raise BadRecord("no_assistant_turn", "no assistant message, so there is nothing to train on")
        return clean

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> tuple[str, list]:
        """The rendered text and its {% generation %} spans; BadRecord if the template fails."""
        import jinja2

        variables = {
            **self.special_tokens,
            **self.template_variables,
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self.template.render_marked(variables)
        except jinja2.TemplateError as exc:
            raise BadRecord("template_error", f"{self.template.where} failed on it: {exc}") from None
        except Exception as exc:
            message = f"{self.template.where} failed on it ({type(exc).__name__}: {exc})"
            raise BadRecord("template_error", message) from None

    def _incremental_spans(self, messages: list[dict[str, Any]], full: str) -> tuple[tuple[int, int], ...]:
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            prompt, _ = self.render(messages[:i], add_generation_prompt=True)
            turn, _ = self.render(messages[: i + 1])
            if not (turn.startswith(prompt) and full.startswith(turn)):
                raise BadRecord(
                    "template_not_incremental",
                    f"under this chat template, rendering messages 0-{i} (with and without the generation prompt) "
                    "is not a prefix of rendering them all, so the assistant's text cannot be located. Mark it in "
                    "the template with {% generation %}...{% endgeneration %} (as transformers' "
                    "return_assistant_tokens_mask requires)",
                )
            end = max(len(turn.rstrip()), len(prompt))
            if end > len(prompt):
                spans.append((len(prompt), end))
        return tuple(spans)

    def prepare(self, record: Mapping[str, Any]) -> LossSpans:
        """The rendered conversation and its target spans (the assistant's text, or all of it)."""
        messages = self.messages(record)
        text, marked = self.render(messages)
        if not self.mask_user_turns:
            return LossSpans(text, ((0, len(text)),))
        spans = tuple(marked) if self.template.marks_generation else self._incremental_spans(messages, text)
        if not spans:
            raise BadRecord("no_assistant_turn", "the assistant messages render to no text, so nothing to train on")
        return LossSpans(text, spans)

    def __call__(self, docs: list[LossSpans]) -> pa.RecordBatch:
        """input_ids (exactly apply_chat_template's) and loss_mask of each prepared conversation."""
        return self._tokenize(docs)
