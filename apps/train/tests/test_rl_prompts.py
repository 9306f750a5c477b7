"""RL's prompts through a shard-cache prompt cache: chat-message prompts are tokenized to the ids of transformers'
apply_chat_template, text prompts beside them are unchanged, bad messages name the record, and each step's prompts,
read from the cache, are a pure function of (seed, step): a reader restarted at step k draws what the first drew."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_train.config.data_config import DataConfig
from lm_train.config.data_formats import ChatFormat
from lm_train.errors import DataError
from lm_train.post.rl.prompts import PromptSet, build_prompt_cache, prompt_cache_dir, prompt_processor, step_prompts

SPECIAL = ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
WORDS = ["[UNK]", *SPECIAL, "what", "is", "+", "=", *[str(i) for i in range(10)]]
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [{"role": "user", "content": "what is 3 + 4"}]


@pytest.fixture(scope="module")
def ray_for_builds(tmp_path_factory):
    """One quiet local Ray for the module's cache builds (a build would otherwise start one per call)."""
    import os

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 2**20,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
    )
    yield
    ray.shutdown()


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


def _prompts(tmp_path: Path, tokenizer_file: Path, url: str, template: str | None = TEMPLATE) -> PromptSet:
    """The prompt cache of `url`, built as `lm-train rl` builds it (data.format: chat names the template)."""
    data = DataConfig(
        cache_dir=str(tmp_path / "cache"), tokenizer=str(tokenizer_file), format=ChatFormat(chat_template=template)
    )
    processor = prompt_processor(data, str(tokenizer_file), "prompt")
    root = prompt_cache_dir(data, str(tokenizer_file), processor)
    build_prompt_cache([url], f"{root}/train", processor, data, progress=False)
    return PromptSet(f"{root}/train")


def test_chat_prompts_are_apply_chat_templates_ids(tokenizer_file, tmp_path, ray_for_builds):
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


def test_bad_chat_prompts_name_the_record(tokenizer_file, tmp_path, ray_for_builds):
    url = _write(tmp_path / "p.jsonl", [{"prompt": "1 + 2"}, {"prompt": [{"content": "1 + 2"}]}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: message 0 has no 'role'.* Fix the record"):
        _prompts(tmp_path / "a", tokenizer_file, url)
    # A tokenizer.json file carries no chat template: the error says where one is needed, and how to give it.
    with pytest.raises(DataError, match=r"p\.jsonl:2: the record's prompt is chat messages, but .*chat_template"):
        _prompts(tmp_path / "b", tokenizer_file, url, template=None)


def test_each_steps_prompts_are_a_pure_function_of_seed_and_step(tokenizer_file, tmp_path, ray_for_builds):
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
