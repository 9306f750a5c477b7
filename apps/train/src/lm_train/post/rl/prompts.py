"""RL's prompts: the records of data.train_urls (and data.validation_urls) tokenized into shard-cache prompt caches
(text prompts, or chat messages rendered with the chat template), checked against the context and the rewards'
fields before anything is sampled, and each step's prompts read from the cache in a seeded order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import shard_cache
from lm_train.config.data_config import DataConfig
from lm_train.data import DATA_TIMEOUT_S
from lm_train.data.caches import cache_tag
from lm_train.errors import DataError
from lm_train.post.rl.rewards import Reward


@dataclass(frozen=True)
class Prompt:
    """One record: where it came from (file:line), the record itself and its prompt's token ids."""

    where: str
    record: Mapping[str, Any]
    ids: tuple[int, ...]


class PromptSet:
    """The prompts of one finished prompt cache, read by index (the chunks that hold them, as they are needed)."""

    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir
        self.records = shard_cache.PromptRecords(shard_cache.open_cache(cache_dir, timeout=DATA_TIMEOUT_S))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Prompt:
        record, where = self.records.record(index)
        return Prompt(where, record, tuple(int(t) for t in self.records.ids(index)))

    def all(self) -> list[Prompt]:
        """Every prompt, in the cache's order."""
        return [self[i] for i in range(len(self))]

    def check(self, rewards: Sequence[Reward], context: int, max_new_tokens: int) -> None:
        """A DataError naming the file and line of the first record whose prompt leaves no room for max_new_tokens,
        or that lacks a field a reward reads."""
        if not len(self):
            raise DataError(f"the prompt cache {self.cache_dir} holds no record: RL needs prompts to sample from.")
        lengths = self.records.lengths()
        for index in np.flatnonzero(lengths + max_new_tokens > context)[:1]:
            where = self.records.record(int(index))[1]
            raise DataError(
                f"{where}: the prompt is {lengths[index]} tokens, and with rl.max_new_tokens ({max_new_tokens}) it "
                f"exceeds the context (model.seq_len {context}); shorten the prompt, lower rl.max_new_tokens or "
                "raise model.seq_len."
            )
        needed = {name: reward for reward in rewards for name in reward.fields()}
        if not needed:
            return
        for index in range(len(self)):
            record, where = self.records.record(index)
            for name, reward in needed.items():
                if name not in record:
                    raise DataError(
                        f"{where}: the record has no {name!r} field, which reward {reward.label} ({reward.path}) "
                        f"reads (keys: {sorted(record)}); add it to every record, or set the reward's kwargs.field."
                    )


def prompt_processor(data: DataConfig, tokenizer_path: str, prompt_field: str) -> Any:
    """The shard-cache processor of RL's prompt records (data.format: chat's template renders chat prompts)."""
    template = getattr(data.format, "chat_template", None)
    try:
        return shard_cache.PromptProcessor(tokenizer_path, prompt_field=prompt_field, chat_template=template)
    except shard_cache.ShardCacheError as error:
        raise DataError(f"data.tokenizer: {error}") from None


def prompt_cache_dir(data: DataConfig, tokenizer_path: str, processor: Any) -> str:
    """Where the prompt caches live: <data.cache_dir>/<tokenizer tag>-rl-prompts-<settings digest>/."""
    digest = shard_cache.prompt_settings_digest(processor)
    return f"{data.cache_dir.rstrip('/')}/{cache_tag(tokenizer_path, data)}-rl-prompts-{digest}"


def build_prompt_cache(urls: Sequence[str], cache_dir: str, processor: Any, data: DataConfig, progress: bool) -> None:
    """Tokenize the records of `urls` into the prompt cache at `cache_dir` (found finished, resumed or built); a bad
    record is a DataError naming its file and line."""
    try:
        shard_cache.build_cache(
            list(urls),
            cache_dir,
            processor=processor,
            fmt="jsonl",
            chunk_size=data.chunk_size,
            num_workers=data.num_workers,
            in_process=data.build_in_process,
            progress=progress,
        )
    except shard_cache.BadInputError as error:
        # shard-cache's own fix names its skip option; lm-train rl samples from every record, and skips none.
        message = str(error).partition(" Fix the input, or pass on_bad_input")[0]
        raise DataError(
            f"{message} Fix the record; give every record its prompt in rl.prompt_field as text or chat messages "
            "(these need a chat template: data.format: {type: chat, chat_template: ...} or a tokenizer directory "
            "with one)."
        ) from None


def step_prompts(count: int, step: int, per_step: int, seed: int) -> np.ndarray:
    """The indices of step `step`'s prompts among `count`: each epoch in its own seeded permutation."""
    positions = np.arange(step * per_step, (step + 1) * per_step, dtype=np.int64)
    out = np.empty_like(positions)
    for epoch in np.unique(positions // count):
        order = np.random.default_rng([seed, int(epoch)]).permutation(count)
        chosen = positions // count == epoch
        out[chosen] = order[positions[chosen] % count]
    return out
