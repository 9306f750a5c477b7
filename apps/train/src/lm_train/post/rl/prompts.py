"""RL's prompts: the records of data.train_urls (and data.validation_urls) tokenized into shard-cache prompt caches
(text prompts, or chat messages rendered with the chat template), checked against the context and the rewards'
fields before anything is sampled, and each step's prompts read from the cache in a seeded order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

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
    """The prompts of one finished prompt cache, read by index (the chunks that hold them, as they are needed); with
    `kept`, only those rows of the cache (the others were left out by rl.on_bad_prompt: skip)."""

    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir
        self.records = shard_cache.PromptRecords(shard_cache.open_cache(cache_dir, timeout=DATA_TIMEOUT_S))
        self.kept: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.records) if self.kept is None else len(self.kept)

    def __getitem__(self, index: int) -> Prompt:
        row = index if self.kept is None else int(self.kept[index])
        record, where = self.records.record(row)
        return Prompt(where, record, tuple(int(t) for t in self.records.ids(row)))

    def all(self) -> list[Prompt]:
        """Every prompt, in the cache's order."""
        return [self[i] for i in range(len(self))]

    def check(self, rewards: Sequence[Reward], context: int, max_new_tokens: int, skip: bool = False) -> list[str]:
        """A DataError naming the file and line of the first record whose prompt leaves no room for max_new_tokens,
        or that lacks a field a reward reads; with `skip`, records of the latter are left out instead, and where
        they were read is returned."""
        if not len(self.records):
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
            return []
        left_out: list[int] = []
        wheres: list[str] = []
        for index in range(len(self.records)):
            record, where = self.records.record(index)
            for name, reward in needed.items():
                if name in record:
                    continue
                if skip:
                    left_out.append(index)
                    wheres.append(where)
                    break
                raise DataError(
                    f"{where}: the record has no {name!r} field, which reward {reward.label} ({reward.path}) "
                    f"reads (keys: {sorted(record)}); add it to every record, set the reward's kwargs.field, or "
                    "leave such records out with rl.on_bad_prompt: skip."
                )
        if left_out:
            self.kept = np.setdiff1d(np.arange(len(self.records), dtype=np.int64), left_out)
            if not len(self.kept):
                raise DataError(f"{self.cache_dir}: every prompt record lacks a field that the rewards read.")
        return wheres


def prompt_processor(data: DataConfig, tokenizer_path: str, prompt_field: str) -> Any:
    """The shard-cache processor of RL's prompt records (data.format: chat's template renders chat prompts)."""
    template = getattr(data.format, "chat_template", None)
    try:
        return shard_cache.PromptProcessor(tokenizer_path, prompt_field=prompt_field, chat_template=template)
    except shard_cache.ShardCacheError as error:
        raise DataError(f"data.tokenizer: {error}") from None


def prompt_cache_dir(data: DataConfig, tokenizer_path: str, processor: Any, skip: bool = False) -> str:
    """Where the prompt caches live: <data.cache_dir>/<tokenizer tag>-rl-prompts-<settings digest>/ (-skip: built
    leaving bad records out, which the build records among its settings)."""
    digest = shard_cache.prompt_settings_digest(processor)
    suffix = "-skip" if skip else ""
    return f"{data.cache_dir.rstrip('/')}/{cache_tag(tokenizer_path, data)}-rl-prompts-{digest}{suffix}"


def _read_format(urls: Sequence[str], processor: Any) -> Literal["jsonl", "auto"]:
    """jsonl, as every prompt file was read before parquet; with a parquet file among `urls`, each file by its name
    (.jsonl/.json, .parquet), and the processor reads every column of the parquet files: the whole record, as a
    jsonl line gives it."""
    if not any(url.rstrip("/").endswith(".parquet") for url in urls):
        return "jsonl"
    import pyarrow.parquet as pq

    columns = list(processor.record_fields)
    for url in shard_cache.expand_inputs(list(urls)):
        if url.endswith(".parquet"):
            fs, path = shard_cache.get_fs(url)
            try:
                with fs.open(path, "rb") as f:
                    names = pq.read_schema(f).names
            except Exception as error:
                raise DataError(f"{url}: not a readable Parquet file ({error}).") from None
            columns += [name for name in names if name not in columns]
    processor.record_fields = tuple(columns)
    return "auto"


def build_prompt_cache(
    urls: Sequence[str], cache_dir: str, processor: Any, data: DataConfig, progress: bool, skip: bool = False
) -> dict[str, int]:
    """Tokenize the records of `urls` (jsonl or parquet) into the prompt cache at `cache_dir` (found finished, resumed
    or built); a bad record is a DataError naming its file and line, or with `skip`, left out. The records left out,
    counted by reason."""
    fmt = _read_format(urls, processor)
    try:
        result = shard_cache.build_cache(
            list(urls),
            cache_dir,
            processor=processor,
            fmt=fmt,
            on_bad_input="skip" if skip else "fail",
            chunk_size=data.chunk_size,
            num_workers=data.num_workers,
            in_process=data.build_in_process,
            progress=progress,
        )
    except shard_cache.BadInputError as error:
        # shard-cache's own fix names its skip option; lm-train rl's is rl.on_bad_prompt.
        message = str(error).partition(" Fix the input, or pass on_bad_input")[0]
        raise DataError(
            f"{message} Fix the record, or leave such records out with rl.on_bad_prompt: skip; give every record its "
            "prompt in rl.prompt_field as text or chat messages (these need a chat template: data.format: {type: "
            "chat, chat_template: ...} or a tokenizer directory with one)."
        ) from None
    return dict(result.skipped)


def first_skipped(urls: Sequence[str], processor: Any, count: int = 5) -> list[str]:
    """Where the first `count` records that the processor refuses were read (file and line or row): the files are
    read again only as far as it takes to find them, in the build's order of files."""
    fmt = _read_format(urls, processor)
    found: list[str] = []

    def prepare(record: Mapping[str, Any], where: str = "") -> Any:
        try:
            return processor.prepare(record, where)
        except shard_cache.BadRecord:
            found.append(where)
            raise

    for url in shard_cache.expand_inputs(list(urls)):
        reader = shard_cache.DocumentReader(
            url, fmt, on_bad_input="skip", prepare=prepare, record_fields=processor.record_fields, located=True
        )
        for _ in reader:
            if len(found) >= count:
                return found
    return found[:count]


def step_prompts(count: int, step: int, per_step: int, seed: int) -> np.ndarray:
    """The indices of step `step`'s prompts among `count`: each epoch in its own seeded permutation."""
    positions = np.arange(step * per_step, (step + 1) * per_step, dtype=np.int64)
    out = np.empty_like(positions)
    for epoch in np.unique(positions // count):
        order = np.random.default_rng([seed, int(epoch)]).permutation(count)
        chosen = positions // count == epoch
        out[chosen] = order[positions[chosen] % count]
    return out
