"""RL's prompts: the records of data.train_urls (jsonl), their prompts (text, or chat messages rendered with the chat
template) tokenized and checked against the context and the rewards' fields before anything is sampled, and the
prompts of each step in a seeded order."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import shard_cache
from lm_train.errors import DataError
from lm_train.post.rl.rewards import Reward


@dataclass(frozen=True)
class Prompt:
    """One record: where it came from (file:line), the record itself and its prompt's token ids."""

    where: str
    record: Mapping[str, Any]
    ids: tuple[int, ...]


def _records(url: str) -> list[tuple[str, dict[str, Any]]]:
    fs, path = shard_cache.get_fs(url)
    text = shard_cache.read_bytes(fs, path).decode("utf-8")
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{url}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{where}: not a JSON object ({error.msg}); each line of an RL prompt file is one."
            ) from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: a {type(record).__name__}, not a JSON object; each line is one record.")
        out.append((where, record))
    return out


def chat_renderer(tokenizer_path: str, prompt_field: str, chat_template: str | None) -> Callable[[Any], str]:
    """A function from a record to its messages rendered by the chat template with the generation prompt after
    them (as transformers' apply_chat_template(messages, add_generation_prompt=True)); the template is read on the
    first call, so runs with text prompts need none."""
    processor: list[Any] = []

    def render(record: Any) -> str:
        if not processor:
            processor.append(
                shard_cache.ChatProcessor(
                    tokenizer_path, chat_template=chat_template, messages_field=prompt_field, mask_user_turns=False
                )
            )
        chat = processor[0]
        return chat.render(chat.messages(record), add_generation_prompt=True)[0]

    return render


def _prompt_text(record: dict[str, Any], where: str, prompt_field: str, chat: Callable[[Any], str] | None) -> str:
    text = record.get(prompt_field)
    if isinstance(text, list) and chat is not None:
        try:
            return chat(record)
        except shard_cache.BadRecord as error:
            raise DataError(
                f"{where}: the chat messages in {prompt_field!r} cannot be rendered: {error.message}."
            ) from None
        except shard_cache.ShardCacheError as error:
            raise DataError(
                f"{where}: the record's prompt is chat messages, but {error} In the config: give data.tokenizer as a "
                "Hugging Face tokenizer directory with a chat template, or set data.format: {type: chat, "
                "chat_template: ...}."
            ) from None
    if not isinstance(text, str) or not text:
        raise DataError(
            f"{where}: the record has no prompt text or chat messages in its {prompt_field!r} field (keys: "
            f"{sorted(record)}); give every record one, or name the field with rl.prompt_field."
        )
    return text


def load_prompts(
    urls: Sequence[str],
    tokenizer: Any,
    prompt_field: str,
    rewards: Sequence[Reward],
    context: int,
    max_new_tokens: int,
    chat: Callable[[Any], str] | None = None,
) -> list[Prompt]:
    """Every record of `urls` with its tokenized prompt (`chat` renders a list of messages; see chat_renderer); a
    DataError naming the file and line of the first record without a field a reward reads, without a prompt, or whose
    prompt leaves no room for max_new_tokens."""
    needed = {name: reward for reward in rewards for name in reward.fields()}
    prompts = []
    for url in shard_cache.expand_inputs(list(urls)):
        for where, record in _records(url):
            text = _prompt_text(record, where, prompt_field, chat)
            for name, reward in needed.items():
                if name not in record:
                    raise DataError(
                        f"{where}: the record has no {name!r} field, which reward {reward.label} ({reward.path}) "
                        f"reads (keys: {sorted(record)}); add it to every record, or set the reward's kwargs.field."
                    )
            ids = tuple(tokenizer.encode(text, add_special_tokens=False).ids)
            if not ids:
                raise DataError(f"{where}: the prompt {text[:60]!r} tokenizes to no token.")
            if len(ids) + max_new_tokens > context:
                raise DataError(
                    f"{where}: the prompt is {len(ids)} tokens, and with rl.max_new_tokens ({max_new_tokens}) it "
                    f"exceeds the context (model.seq_len {context}); shorten the prompt, lower rl.max_new_tokens or "
                    "raise model.seq_len."
                )
            prompts.append(Prompt(where, record, ids))
    if not prompts:
        raise DataError(f"data.train_urls {list(urls)} hold no record: RL needs prompts to sample from.")
    return prompts


def step_prompts(count: int, step: int, per_step: int, seed: int) -> np.ndarray:
    """The indices of step `step`'s prompts among `count`: each epoch in its own seeded permutation."""
    positions = np.arange(step * per_step, (step + 1) * per_step, dtype=np.int64)
    out = np.empty_like(positions)
    for epoch in np.unique(positions // count):
        order = np.random.default_rng([seed, int(epoch)]).permutation(count)
        chosen = positions // count == epoch
        out[chosen] = order[positions[chosen] % count]
    return out
