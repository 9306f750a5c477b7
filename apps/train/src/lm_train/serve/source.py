"""What `lm-train serve` serves: a checkpoint, a run directory or a Hugging Face export, with its tokenizer and chat
template, read into a model in memory and the text functions of the server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_train.errors import UserError

from .params import RequestError

# The chat template of a tokenizer that has none (a run's bare tokenizer.json): ChatML, written as plain text.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# End-of-text tokens, by the names tokenizers commonly give them, for a tokenizer that does not say which.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>")


class ChatError(RequestError):
    """A chat request's messages that the template cannot render."""


@dataclass
class Source:
    """A model in memory with its tokenizer, the name it is served under and how chats become prompts."""

    model: Any
    tokenizer: Any
    name: str
    eos_token_id: int | None
    chat: Any  # shard_cache.ChatProcessor

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: list[dict]) -> list[int]:
        """The prompt of a conversation: the chat template with the generation prompt, tokenized."""
        from shard_cache import BadRecord

        try:
            text, _ = self.chat.render(self.chat.messages({"messages": messages}), add_generation_prompt=True)
        except BadRecord as e:
            raise ChatError(f"messages: {e}", "messages") from None
        return self.encode(text)


def load_source(
    source: str,
    *,
    chat_template: str | None = None,
    name: str | None = None,
    lora: str | None = None,
    weights: str | None = None,
) -> Source:
    """A Hugging Face export directory (config.json beside the weights), or a checkpoint or run directory (its
    `weights`: ema, raw, or None for the run's choice); with `lora`, a PEFT adapter directory merged into the
    weights."""
    import shard_cache

    path = Path(source)
    check_weights_of(path, weights)
    if (path / "config.json").is_file():
        import hf_bridge

        model, _ = hf_bridge.load_pretrained(path)
        tokenizer = hf_bridge.load_tokenizer(path)
        special = hf_bridge.load_special_tokens(path)
        eos = tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else _guess_eos(tokenizer)
        directory = str(path)
        has_template = (path / "chat_template.jinja").is_file() or "chat_template" in _json(
            path / "tokenizer_config.json"
        )
        template = chat_template if chat_template is not None or has_template else DEFAULT_CHAT_TEMPLATE
        chat = shard_cache.ChatProcessor(directory, chat_template=template, mask_user_turns=False)
    else:
        from lm_train.run.checkpoints import load_model

        loaded = load_model(source, weights)
        model, tokenizer = loaded.model, loaded.tokenizer
        eos = _guess_eos(tokenizer)
        chat = shard_cache.ChatProcessor(
            tokenizer, chat_template=chat_template or DEFAULT_CHAT_TEMPLATE, mask_user_turns=False, special_tokens={}
        )
    if lora is not None:
        model = merged_adapter(model, lora)
    return Source(model, tokenizer, name or path.resolve().name, eos, chat)


def merged_adapter(model: Any, lora: str) -> Any:
    """The model with the PEFT adapter at `lora` (as hf_bridge reads it) merged into its weights: served at the
    base model's cost, one adapter per server."""
    import hf_bridge
    import named_tensors as nt

    try:
        return nt.nn.merge_lora(hf_bridge.load_peft_adapter(lora, model))
    except hf_bridge.HfBridgeError as e:
        raise UserError(f"--lora {lora}: {e}") from None


def check_weights_of(path: Path, weights: str | None) -> None:
    """A UserError for a bad --weights, or one given for a Hugging Face export (it holds one set of weights)."""
    from lm_train.run.model_averaging import check_weights

    check_weights(weights)
    if weights is not None and (path / "config.json").is_file():
        raise UserError(
            f"--weights {weights}: {path} is a Hugging Face export, which holds one set of weights (the run chose "
            "them as it exported); --weights applies to a checkpoint or run directory. Leave it out."
        )


def check_adapter_dir(lora: str) -> None:
    """A UserError unless `lora` looks like a PEFT adapter directory; before anything is loaded."""
    if not (Path(lora) / "adapter_config.json").is_file():
        raise UserError(f"--lora {lora}: no adapter_config.json there; give the directory of a PEFT adapter (as "
                        "`lm-train export-hf --lora` or peft's save_pretrained writes it).")  # fmt: skip


def _guess_eos(tokenizer: Any) -> int | None:
    for token in EOS_NAMES:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    return None


def _json(path: Path) -> dict:
    import json

    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); fix or regenerate it.") from None
    return content if isinstance(content, dict) else {}
