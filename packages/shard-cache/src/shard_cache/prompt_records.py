"""Prompt records for reinforcement learning: each record's prompt tokenized as the sampler gets it, kept with the
record itself and where it was read.

A record holds a prompt (`prompt_field`: text, or a list of chat messages rendered with the chat template and the
generation prompt, as transformers' `apply_chat_template(messages, add_generation_prompt=True)`) and whatever a
reward reads (an answer, test cases). One cache row per record: `input_ids` (list<int32>, the prompt's tokens without
special tokens added and without an EOS: the model continues it), `record` (the record as JSON text) and `where`
(the file and line it came from). `PromptRecords` reads them back by index.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from shard_cache.errors import ShardCacheError
from shard_cache.processor import load_tokenizer
from shard_cache.reader import CacheReader
from shard_cache.records import BadRecord, list_column, tokenizer_sha256

RECORD = "record"
WHERE = "where"


@dataclass(frozen=True)
class PreparedPrompt:
    """A record ready to tokenize: its prompt's text, the record as JSON, and its file and line."""

    text: str
    record: str
    where: str


class PromptProcessor:
    """Records with a prompt (text or chat messages) and any other fields: `input_ids`, `record` and `where` per row.

    `tokenizer`: a tokenizer.json or an HF tokenizer directory (its chat template is used for chat prompts, unless
    `chat_template` names or gives one). A record whose prompt is chat messages needs a template; without one it is
    a bad record, so that text prompts need none.
    """

    kind = "prompt"
    locates_records = True  # the reader passes each record's file and line to prepare

    def __init__(self, tokenizer: str, *, prompt_field: str = "prompt", chat_template: str | None = None):
        self.tokenizer_path = str(tokenizer)
        self.tokenizer: Tokenizer = load_tokenizer(self.tokenizer_path)
        self.prompt_field = prompt_field
        self.chat_template = chat_template
        self.record_fields = (prompt_field,)
        self._chat: Any = None
        self._chat_error = ""
        try:
            from shard_cache.chat import ChatProcessor

            self._chat = ChatProcessor(
                self.tokenizer_path, chat_template=chat_template, messages_field=prompt_field, mask_user_turns=False
            )
        except ShardCacheError as error:  # no template: only chat prompts need one
            self._chat_error = str(error)
        self._tokenizer_sha256 = tokenizer_sha256(self.tokenizer)

    def fingerprint(self) -> dict[str, Any]:
        """Settings that determine the output."""
        template = None if self._chat is None else self._chat.fingerprint()["template_sha256"]
        return {
            "kind": self.kind,
            "tokenizer_sha256": self._tokenizer_sha256,
            "prompt_field": self.prompt_field,
            "template_sha256": template,
        }

    def prepare(self, record: Mapping[str, Any], where: str = "") -> PreparedPrompt:
        """The prompt's text (chat messages rendered), or BadRecord naming what is wrong."""
        prompt = record.get(self.prompt_field)
        if isinstance(prompt, list):
            if self._chat is None:
                raise BadRecord(
                    "no_chat_template",
                    f"the record's prompt is chat messages, but {self._chat_error.rstrip('.')}. Give a tokenizer "
                    "directory with a chat template, or a chat_template",
                )
            text = self._chat.render(self._chat.messages(record), add_generation_prompt=True)[0]
        elif isinstance(prompt, str) and prompt:
            text = prompt
        else:
            keys = ", ".join(sorted(map(str, record))[:10])
            raise BadRecord(
                "missing_prompt",
                f"no prompt text or chat messages in its {self.prompt_field!r} field (the record has: {keys})",
            )
        if not self.tokenizer.encode(text, add_special_tokens=False).ids:
            raise BadRecord("empty_prompt", f"the prompt {text[:60]!r} tokenizes to no token")
        return PreparedPrompt(text, json.dumps(record, ensure_ascii=False), where)

    def __call__(self, docs: list[PreparedPrompt]) -> pa.RecordBatch:
        """input_ids, record and where of each prepared prompt."""
        encodings = self.tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
        columns = [
            list_column(ids, np.int32, pa.int32()),
            pa.array([d.record for d in docs], type=pa.string()),
            pa.array([d.where for d in docs], type=pa.string()),
        ]
        return pa.RecordBatch.from_arrays(columns, names=["input_ids", RECORD, WHERE])


def processor_from_fingerprint(wanted: Mapping[str, Any], tokenizer: str, chat_template: str | None) -> PromptProcessor:
    """The PromptProcessor a cache was built with, for a repair (the template as given to the build)."""
    processor = PromptProcessor(tokenizer, prompt_field=wanted["prompt_field"], chat_template=chat_template)
    if processor.fingerprint() != dict(wanted):
        raise ShardCacheError(
            "the prompt cache was built with another tokenizer or chat template than the one given; pass the "
            "tokenizer (directory) and chat_template the build used."
        )
    return processor


class PromptRecords:
    """The rows of a prompt cache by global index: each record's prompt ids, the record, and where it was read."""

    def __init__(self, reader: CacheReader):
        self.reader = reader

    def __len__(self) -> int:
        """Records committed so far (all of them once the build has finished)."""
        return self.reader.num_docs

    def ids(self, index: int) -> np.ndarray:
        """The prompt's token ids of record `index`."""
        return self.reader.document(index)

    def record(self, index: int) -> tuple[dict[str, Any], str]:
        """Record `index` and the file and line it was read from."""
        record, where = self.reader.document_value(index, RECORD), self.reader.document_value(index, WHERE)
        if record is None or where is None:
            raise ShardCacheError(
                f"{self.reader.url}: the cache has no {RECORD!r} and {WHERE!r} columns, so it does not hold prompt "
                "records. Build it with shard_cache.PromptProcessor."
            )
        return json.loads(record), where

    def lengths(self) -> np.ndarray:
        """Every committed record's prompt length, in tokens (read from the chunks' offsets)."""
        out = [np.diff(self.reader.chunk(g).doc_offsets) for g in range(self.reader.num_chunks)]
        return np.concatenate(out) if out else np.zeros(0, np.int64)


def prompt_settings_digest(processor: PromptProcessor) -> str:
    """A short digest of the processor's settings, for a cache folder's name."""
    return hashlib.sha256(json.dumps(processor.fingerprint(), sort_keys=True).encode()).hexdigest()[:10]


__all__ = ["RECORD", "WHERE", "PreparedPrompt", "PromptProcessor", "PromptRecords", "prompt_settings_digest"]
