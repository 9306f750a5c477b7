"""`data.format`: how records become training examples (Levanter's dataset formats and keys), by `type`.

- `text`: the text of each document (pretraining), every token a target;
- `chat`: OpenAI-style `messages`, rendered with the chat template, the loss on the assistant's turns;
- `prompt_completion`: `prompt` and `completion` fields, the loss on the completion;
- `supervised`: Levanter's name and keys for the same (`input_field`, `output_field`, `separate_with`).

Chat and prompt/completion records store a `loss_mask` column beside `input_ids` in the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from lm_models import config_registry
from lm_train.errors import ConfigError

if TYPE_CHECKING:
    from shard_cache import BatchProcessor

FormatT = TypeVar("FormatT", bound=type)


@config_registry("data format", default="text")
class DataFormat:
    """Base of the record formats, selected by `data.format.type`; each builds its own shard-cache processor.

    A new format is one registered config whose `processor` turns records into `input_ids` (and a `loss_mask`
    where `has_loss_mask`). shard-cache is imported inside `processor`, so that reading a config stays light.
    """

    @property
    def has_loss_mask(self) -> bool:
        return False

    def processor(self, tokenizer_path: str, *, enforce_eos: bool = True) -> BatchProcessor:
        """The processor that turns this format's records into training examples."""
        raise ConfigError(
            f"data.format type {type(self).__name__} is registered without a processor: define "
            "processor(tokenizer_path, enforce_eos=...) on its config class, returning a shard-cache BatchProcessor."
        )

    if TYPE_CHECKING:  # installed at run time by @config_registry above; declared for type checkers

        @classmethod
        def register_subclass(cls, name: str) -> Callable[[FormatT], FormatT]: ...
        @classmethod
        def get_choice_class(cls, name: str) -> type[DataFormat]: ...
        @classmethod
        def get_known_choices(cls) -> dict[str, type[DataFormat]]: ...
        @classmethod
        def get_choice_name(cls, subcls: type) -> str: ...
        @classmethod
        def default_choice_name(cls) -> str | None: ...
        @classmethod
        def unregister(cls, name: str) -> None: ...


@DataFormat.register_subclass("text")
@dataclass(frozen=True)
class TextFormat(DataFormat):
    """Plain documents: jsonl/parquet records with a text field, or text files."""

    text_key: str | None = None
    """The field that holds the text; None: `data.text_key`."""

    def processor(self, tokenizer_path: str, *, enforce_eos: bool = True) -> BatchProcessor:
        import shard_cache

        return shard_cache.TokenizerProcessor(tokenizer_path, enforce_eos=enforce_eos)


@DataFormat.register_subclass("chat")
@dataclass(frozen=True)
class ChatFormat(DataFormat):
    """Conversations: a list of {role, content} messages per record, rendered with a chat template."""

    messages_field: str = "messages"
    """The record field that holds the messages."""
    chat_template: str | None = None
    """A jinja chat template, or the name of one of the tokenizer's; None: the tokenizer's tokenizer_config.json."""
    mask_user_turns: bool = True
    """Train on the assistant's turns only; false: on every token."""
    pack: bool | None = None
    """Levanter's place for `data.pack`; None: as `data.pack` says."""

    @property
    def has_loss_mask(self) -> bool:
        return True

    def processor(self, tokenizer_path: str, *, enforce_eos: bool = True) -> BatchProcessor:
        import shard_cache

        return shard_cache.ChatProcessor(
            tokenizer_path,
            chat_template=self.chat_template,
            messages_field=self.messages_field,
            mask_user_turns=self.mask_user_turns,
        )


@DataFormat.register_subclass("prompt_completion")
@dataclass(frozen=True)
class PromptCompletionFormat(DataFormat):
    """Single-turn pairs: the loss on the completion (and the end-of-sequence token after it)."""

    prompt_field: str = "prompt"
    """The record field that holds the prompt."""
    completion_field: str = "completion"
    """The record field that holds the completion."""
    mask_prompt: bool = True
    """Train on the completion only; false: on every token."""
    separator: str = ""
    """Text put between prompt and completion (part of the prompt: not trained on)."""
    pack: bool | None = None
    """As `data.pack`; None: as `data.pack` says."""

    @property
    def has_loss_mask(self) -> bool:
        return True

    def processor(self, tokenizer_path: str, *, enforce_eos: bool = True) -> BatchProcessor:
        import shard_cache

        if self.separator:
            from lm_train.data.separated_prompts import SeparatedPromptCompletion

            return SeparatedPromptCompletion(
                tokenizer_path,
                separator=self.separator,
                mask_prompt=self.mask_prompt,
                prompt_field=self.prompt_field,
                completion_field=self.completion_field,
            )
        return shard_cache.PromptCompletionProcessor(
            tokenizer_path,
            mask_prompt=self.mask_prompt,
            prompt_field=self.prompt_field,
            completion_field=self.completion_field,
        )


@DataFormat.register_subclass("supervised")
@dataclass(frozen=True)
class SupervisedFormat(DataFormat):
    """Levanter's `supervised` format: prompt_completion under Levanter's key names."""

    input_field: str = "prompt"
    """The record field that holds the input (the prompt)."""
    output_field: str = "response"
    """The record field that holds the output (the completion)."""
    separate_with: str | None = None
    """Text put between input and output (part of the input: not trained on)."""
    mask_inputs: bool = True
    """Train on the output only; false: on every token."""
    pack: bool | None = None
    """As `data.pack`; None: as `data.pack` says."""

    @property
    def has_loss_mask(self) -> bool:
        return True

    def as_prompt_completion(self) -> PromptCompletionFormat:
        return PromptCompletionFormat(
            self.input_field, self.output_field, self.mask_inputs, self.separate_with or "", self.pack
        )

    def processor(self, tokenizer_path: str, *, enforce_eos: bool = True) -> BatchProcessor:
        return self.as_prompt_completion().processor(tokenizer_path, enforce_eos=enforce_eos)


def format_name(fmt: DataFormat) -> str:
    """The `type` name of a format config."""
    return DataFormat.get_choice_name(type(fmt))


def check_format(fmt: DataFormat) -> None:
    """Settings of a format that cannot work, as a config error."""
    fields = {
        ChatFormat: ("messages_field",),
        PromptCompletionFormat: ("prompt_field", "completion_field"),
        SupervisedFormat: ("input_field", "output_field"),
    }.get(type(fmt), ())
    for name in fields:
        if not getattr(fmt, name):
            raise ConfigError(f"data.format.{name} is empty; name the record field to read.")
    if isinstance(fmt, PromptCompletionFormat) and fmt.prompt_field == fmt.completion_field:
        raise ConfigError("data.format.prompt_field and completion_field name the same field; give two fields.")
