"""RL's prompts through a shard-cache prompt cache: chat-message prompts are tokenized to the ids of transformers'
apply_chat_template, text prompts beside them are unchanged, bad messages name the record, and each step's prompts,
read from the cache, are a pure function of (seed, step): a reader restarted at step k draws what the first drew."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm_train.config.data_config import DataConfig
from lm_train.config.data_formats import ChatFormat
from lm_train.config.rl_config import RewardSpec
from lm_train.errors import DataError
from lm_train.post.rl.prompts import (
    PromptSet,
    build_prompt_cache,
    first_skipped,
    prompt_cache_dir,
    prompt_processor,
    step_prompts,
)
from lm_train.post.rl.rewards import load_rewards

SPECIAL = ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
WORDS = ["[UNK]", *SPECIAL, "what", "is", "+", "=", *[str(i) for i in range(10)]]
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [{"role": "user", "content": "what is 3 + 4"}]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIAL)
    path = tmp_path_factory.mktemp("chat") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _prompts(
    tmp_path: Path,
    tokenizer_file: Path,
    url: str | list[str],
    template: str | None = TEMPLATE,
    skipped: dict | None = None,
) -> PromptSet:
    """The prompt cache of `url`, built as `lm-train rl` builds it (data.format: chat names the template); with
    `skipped` (a dict to fill with the build's counts), as rl.on_bad_prompt: skip builds it."""
    data = DataConfig(
        cache_dir=str(tmp_path / "cache"), tokenizer=str(tokenizer_file), format=ChatFormat(chat_template=template)
    )
    processor = prompt_processor(data, str(tokenizer_file), "prompt")
    skip = skipped is not None
    root = prompt_cache_dir(data, str(tokenizer_file), processor, skip)
    urls = [url] if isinstance(url, str) else url
    counts = build_prompt_cache(urls, f"{root}/train", processor, data, progress=False, skip=skip)
    if skipped is not None:
        skipped.update(counts, first=first_skipped(urls, processor))
    return PromptSet(f"{root}/train")


def test_chat_prompts_are_apply_chat_templates_ids(tokenizer_file, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    url = _write(tmp_path / "p.jsonl", [{"prompt": CHAT, "answer": "7"}, {"prompt": "3 + 4", "answer": "7"}])
    chat_prompt, text_prompt = _prompts(tmp_path, tokenizer_file, url).all()
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    reference.chat_template = TEMPLATE
    expected = reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(chat_prompt.ids) == list(expected)
    assert chat_prompt.ids[-1] == WORDS.index("<|assistant|>")  # the generation prompt ends it
    assert list(text_prompt.ids) == tokenizer.encode("3 + 4", add_special_tokens=False).ids
    assert chat_prompt.record["prompt"] == CHAT and chat_prompt.where.endswith("p.jsonl:1")
    assert text_prompt.record == {"prompt": "3 + 4", "answer": "7"} and text_prompt.where.endswith("p.jsonl:2")


def test_bad_chat_prompts_name_the_record(tokenizer_file, tmp_path):
    url = _write(tmp_path / "p.jsonl", [{"prompt": "1 + 2"}, {"prompt": [{"content": "1 + 2"}]}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: message 0 has no 'role'.* Fix the record"):
        _prompts(tmp_path / "a", tokenizer_file, url)
    # A tokenizer.json file carries no chat template: the error says where one is needed, and how to give it.
    with pytest.raises(DataError, match=r"p\.jsonl:2: the record's prompt is chat messages, but .*chat_template"):
        _prompts(tmp_path / "b", tokenizer_file, url, template=None)


def test_each_steps_prompts_are_a_pure_function_of_seed_and_step(tokenizer_file, tmp_path):
    """Read from the cache as the rollouts read them: the same seed and step give the same prompts, a reader opened
    anew at step k (a resumed run) gives what the first reader gave from step k on, and each epoch draws every
    record once."""
    records = [{"prompt": f"{a} + {b}", "answer": str(a + b)} for a in range(10) for b in range(3)]
    url = _write(tmp_path / "p.jsonl", records)
    prompts = _prompts(tmp_path, tokenizer_file, url)
    count, per_step, seed, steps, k = len(records), 4, 7, 20, 9

    def drawn(reader: PromptSet, first: int, seed: int = seed) -> list[tuple]:
        return [
            (p.where, p.ids, json.dumps(p.record))
            for step in range(first, steps)
            for p in (reader[int(i)] for i in step_prompts(len(reader), step, per_step, seed))
        ]

    first = drawn(prompts, 0)
    restarted = PromptSet(prompts.cache_dir)
    assert drawn(restarted, k) == first[k * per_step :]
    assert drawn(prompts, 0) == first and drawn(prompts, 0, seed + 1) != first
    lines = [int(where.rpartition(":")[2]) for where, _, _ in first]
    assert sorted(lines[:count]) == list(range(1, count + 1))  # one epoch: every record once
    assert all(json.loads(record) == records[line - 1] for line, (_, _, record) in zip(lines, first, strict=True))


RECORDS = [
    {"prompt": "3 + 4", "answer": "7", "meta": {"level": 1, "tags": ["add"]}},
    {"prompt": "what is 1 + 2", "answer": "3", "meta": {"level": 2, "tags": []}},
]


def test_parquet_prompts_are_the_same_records_as_jsonl_locally_and_on_s3(tokenizer_file, tmp_path, s3_server):
    """A parquet file's rows are whole records, every column, as the same records' jsonl lines give them (the
    prompt's ids, the record the rewards get); chat-message prompts too; read from a local path and an s3:// URL."""
    import fsspec

    chat = [{"prompt": CHAT, "answer": "7"}]
    jsonl = _prompts(
        tmp_path / "j", tokenizer_file, [_write(tmp_path / "p.jsonl", RECORDS), _write(tmp_path / "c.jsonl", chat)]
    ).all()
    pq.write_table(pa.Table.from_pylist(RECORDS), tmp_path / "p.parquet")
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "c.parquet")
    local = _prompts(tmp_path / "l", tokenizer_file, [str(tmp_path / "p.parquet"), str(tmp_path / "c.parquet")]).all()
    bucket = s3_server.new_bucket()
    for name in ("p.parquet", "c.parquet"):
        with fsspec.open(s3_server.url(bucket, f"prompts/{name}"), "wb") as f:
            f.write((tmp_path / name).read_bytes())
    urls = [s3_server.url(bucket, "prompts/p.parquet"), s3_server.url(bucket, "prompts/c.parquet")]
    remote = _prompts(tmp_path / "s", tokenizer_file, urls).all()
    for prompts in (local, remote):
        assert [(p.record, p.ids) for p in prompts] == [(p.record, p.ids) for p in jsonl]
        assert [p.where.rpartition("/")[2] for p in prompts] == [
            "p.parquet:row 1",
            "p.parquet:row 2",
            "c.parquet:row 1",
        ]
    assert [p.record for p in jsonl] == [*RECORDS, *chat]  # a chunk of each file in turn: one chunk each here


def test_skip_leaves_bad_prompt_records_out_counts_and_names_them(tokenizer_file, tmp_path):
    """rl.on_bad_prompt: skip: records without a prompt that tokenizes are left out by the build and counted by
    reason, records without a reward's field by the check; the first few are named by file and line; the rest are
    the prompts, in order. With the default (error), the first bad record stops it, named."""
    records = [
        {"prompt": "1 + 2", "answer": "3"},
        {"question": "1 + 2", "answer": "3"},  # no prompt
        {"prompt": "1 + 3"},  # no answer, which exact_answer reads
        {"prompt": "", "answer": "0"},  # an empty prompt
        {"prompt": "2 + 2", "answer": "4"},
    ]
    url = _write(tmp_path / "p.jsonl", records)
    skipped: dict = {}
    prompts = _prompts(tmp_path / "skip", tokenizer_file, url, skipped=skipped)
    first = skipped.pop("first")
    assert skipped == {"missing_prompt": 2}  # shard-cache's reason for both: no prompt text
    assert first == [f"{url}:2", f"{url}:4"]
    rewards = load_rewards([RewardSpec(fn="lm_train.post.rl.rewards:exact_answer")])
    assert prompts.check(rewards, 16, 4, skip=True) == [f"{url}:3"]
    assert [p.where for p in prompts.all()] == [f"{url}:1", f"{url}:5"] and len(prompts) == 2
    assert [int(i) for i in step_prompts(len(prompts), 0, 2, 0)] in ([0, 1], [1, 0])
    with pytest.raises(DataError, match=r"p\.jsonl:2: .*rl\.on_bad_prompt: skip"):
        _prompts(tmp_path / "error", tokenizer_file, url)
    kept = _prompts(tmp_path / "error2", tokenizer_file, _write(tmp_path / "q.jsonl", [records[0], records[2]]))
    with pytest.raises(DataError, match=r"q\.jsonl:2: the record has no 'answer' field.*rl\.on_bad_prompt: skip"):
        kept.check(rewards, 16, 4)
