"""A prompt/completion processor with a separator between the two (Levanter's `separate_with`).

Kept free of the app's other modules: Ray workers unpickle it, and importing it there must stay light.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shard_cache import LossSpans, PromptCompletionProcessor, string_field


class SeparatedPromptCompletion(PromptCompletionProcessor):
    """prompt + separator + completion; the separator belongs to the prompt (no loss on it)."""

    def __init__(self, tokenizer: Any, *, separator: str, **options: Any):
        super().__init__(tokenizer, **options)
        self.separator = separator

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "separator": self.separator}

    def prepare(self, record: Mapping[str, Any]) -> LossSpans:
        prompt = string_field(record, self.prompt_field) + self.separator
        return super().prepare({**record, self.prompt_field: prompt})
