"""Record formats with loss masks: processors that read structured records and store `loss_mask` beside `input_ids`.

A record processor has two steps. `prepare(record)` runs on each record as it is read, where the file and line
are known: it checks the record and turns it into a `LossSpans` (the text to tokenize and the character spans
the model learns to produce), or raises `BadRecord`, which the build reports with the file and line, or skips
and counts under `on_bad_input="skip"`. `__call__(prepared)` then tokenizes a batch of them into `input_ids`
(list<int32>) and `loss_mask` (list<bool>, True where the token is a training target), one row per record.

Token rule: the whole text is tokenized at once (tokens at a span's edge are the ones the full text gives), and
a token is a target when its characters overlap a span; that is how transformers' `assistant_masks` is computed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
from tokenizers import Tokenizer

from shard_cache.processor import BatchProcessor, TokenizerProcessor

LOSS_MASK = "loss_mask"


class BadRecord(Exception):  # noqa: N818 (a signal to the reader, turned into BadInputError there)
    """A record that cannot be used; `reason` is the key it is counted under when skipped."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class LossSpans:
    """A record ready to tokenize: its text and the [start, end) character spans that are training targets."""

    text: str
    spans: tuple[tuple[int, int], ...]


@runtime_checkable
class RecordProcessor(BatchProcessor, Protocol):
    """A batch processor of structured records (jsonl objects, parquet rows, HF dataset rows).

    `record_fields` names the fields it reads (the parquet columns to load); `prepare` checks one record.
    """

    record_fields: tuple[str, ...]

    def prepare(self, record: Mapping[str, Any]) -> Any: ...


def target_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """For tokens with character offsets [n, 2]: True where a token overlaps one of the spans."""
    mask = np.zeros(len(offsets), dtype=bool)
    if len(offsets) == 0:
        return mask
    starts, ends = offsets[:, 0], offsets[:, 1]
    for start, end in spans:
        mask |= (starts < end) & (ends > start)
    return mask


def list_column(rows: Sequence[np.ndarray], dtype: Any, pa_type: pa.DataType) -> pa.ListArray:
    """A list<pa_type> column from one numpy array per row."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    values = np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa_type))


class SpanTokenizer:
    """Tokenizes LossSpans into input_ids and loss_mask, optionally with a BOS first and an EOS last."""

    def __init__(self, tokenizer: Tokenizer, bos_id: int | None = None, eos_id: int | None = None):
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id

    def __call__(self, docs: Sequence[LossSpans]) -> pa.RecordBatch:
        encodings = self.tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
        ids_rows, mask_rows = [], []
        for doc, encoding in zip(docs, encodings, strict=True):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            mask = target_mask(np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), doc.spans)
            if self.bos_id is not None:
                ids, mask = np.concatenate([[self.bos_id], ids]), np.concatenate([[False], mask])
            if self.eos_id is not None:  # the EOS ends the target: the model learns to stop
                ids, mask = np.concatenate([ids, [self.eos_id]]), np.concatenate([mask, [True]])
            ids_rows.append(ids)
            mask_rows.append(mask)
        columns = [list_column(ids_rows, np.int32, pa.int32()), list_column(mask_rows, bool, pa.bool_())]
        return pa.RecordBatch.from_arrays(columns, names=["input_ids", LOSS_MASK])


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def string_field(record: Mapping[str, Any], name: str, *, allow_empty: bool = True) -> str:
    """record[name] as a string, or BadRecord naming what is wrong."""
    if name not in record or record[name] is None:
        keys = ", ".join(sorted(map(str, record))[:10])
        raise BadRecord("missing_field", f"no field {name!r} (the record has: {keys})")
    value = record[name]
    if not isinstance(value, str):
        raise BadRecord("not_a_string", f"field {name!r} holds a {type(value).__name__}, not text")
    if not allow_empty and not value.strip():
        raise BadRecord("empty", f"field {name!r} is empty")
    return value


class SpanRecordProcessor:
    """What processors of string-field records share: the tokenizer, its BOS/EOS, the fields, the span tokenizer."""

    kind = ""  # the fingerprint's "kind", one per subclass

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        record_fields: tuple[str, ...],
        *,
        eos_token: str | None,
        bos_token: str | None,
        add_bos: bool,
    ):
        specials = TokenizerProcessor(tokenizer, eos_token=eos_token, bos_token=bos_token, add_bos=add_bos)
        self.tokenizer = specials.tokenizer
        self.eos_id, self.bos_id = specials.eos_id, specials.bos_id
        self.record_fields = record_fields
        self._tokenize = SpanTokenizer(self.tokenizer, self.bos_id, self.eos_id)
        self._tokenizer_sha256 = tokenizer_sha256(self.tokenizer)

    def fingerprint(self) -> dict[str, Any]:
        """Settings that determine the output."""
        return {
            "kind": self.kind,
            "tokenizer_sha256": self._tokenizer_sha256,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "fields": list(self.record_fields),
        }


class PromptCompletionProcessor(SpanRecordProcessor):
    """`prompt` + `completion` records: the text is prompt + completion as given (no separator is added), then EOS.

    With mask_prompt (the default) the loss covers the completion and the EOS; otherwise every token but the
    BOS. BOS/EOS are found as TokenizerProcessor finds them (the tokenizer directory's config, or known names).
    """

    kind = "prompt_completion"

    def __init__(
        self,
        tokenizer: Tokenizer | str,
        *,
        prompt_field: str = "prompt",
        completion_field: str = "completion",
        mask_prompt: bool = True,
        eos_token: str | None = None,
        bos_token: str | None = None,
        add_bos: bool = False,
    ):
        fields = (prompt_field, completion_field)
        super().__init__(tokenizer, fields, eos_token=eos_token, bos_token=bos_token, add_bos=add_bos)
        self.prompt_field = prompt_field
        self.completion_field = completion_field
        self.mask_prompt = mask_prompt

    def fingerprint(self) -> dict[str, Any]:
        """Settings that determine the output."""
        return {**super().fingerprint(), "mask_prompt": self.mask_prompt}

    def prepare(self, record: Mapping[str, Any]) -> LossSpans:
        """The record's text and its target span (the completion, or everything without mask_prompt)."""
        prompt = string_field(record, self.prompt_field)
        completion = string_field(record, self.completion_field, allow_empty=False)
        text = prompt + completion
        start = len(prompt) if self.mask_prompt else 0
        return LossSpans(text, ((start, len(text)),))

    def __call__(self, docs: list[LossSpans]) -> pa.RecordBatch:
        """input_ids and loss_mask of each prepared record."""
        return self._tokenize(docs)


__all__ = [
    "LOSS_MASK",
    "BadRecord",
    "LossSpans",
    "PromptCompletionProcessor",
    "RecordProcessor",
    "target_mask",
]
