"""RL's prompt records: text and chat prompts tokenized as transformers' apply_chat_template (with the generation
prompt) gives them, each row's record and file:line read back with plain pyarrow and through PromptRecords; a
damaged chunk repaired to its bytes; a bad record named by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shard_cache import BadInputError, PromptProcessor, PromptRecords, build_cache, open_cache, repair_cache

SPECIALS = ["<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"]
WORDS = ["[UNK]", *SPECIALS, "what", "is", "+", "=", *[str(i) for i in range(10)]]
TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    path = tmp_path_factory.mktemp("prompts") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def _records(count: int) -> list[dict]:
    """Sums with their answers; every third prompt is chat messages."""
    out = []
    for i in range(count):
        text = f"what is {i % 10} + {(3 * i) % 10}"
        prompt = [{"role": "user", "content": text}] if i % 3 == 0 else text
        out.append({"prompt": prompt, "answer": str(i % 10 + (3 * i) % 10), "id": i})
    return out


def test_prompt_rows_hold_apply_chat_template_ids_the_record_and_its_line(tmp_path, tokenizer_file):
    import transformers
    from tokenizers import Tokenizer

    records = _records(20)
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 4 else "") for i, r in enumerate(records)))
    cache = tmp_path / "cache"
    processor = PromptProcessor(str(tokenizer_file), chat_template=TEMPLATE)
    assert build_cache([str(source)], str(cache), processor=processor, chunk_size=8, progress=False).docs == 20
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    reference.chat_template = TEMPLATE
    rows = [row for path in sorted(cache.rglob("*.parquet")) for row in pq.read_table(path).to_pylist()]
    prompts = PromptRecords(open_cache(str(cache)))
    assert len(rows) == len(prompts) == 20
    for i, (row, record) in enumerate(zip(rows, records, strict=True)):
        if isinstance(record["prompt"], list):
            expected = reference.apply_chat_template(
                record["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            expected = tokenizer.encode(record["prompt"], add_special_tokens=False).ids
        line = i + 1 + (i > 4)  # a blank line after the fifth record
        assert row["input_ids"] == list(expected) == prompts.ids(i).tolist()
        assert json.loads(row["record"]) == record and row["where"] == f"{source}:{line}"
        assert prompts.record(i) == (record, f"{source}:{line}")
    assert prompts.lengths().tolist() == [len(row["input_ids"]) for row in rows]
    # A damaged chunk is rebuilt from its records with the same bytes (the processor comes from the fingerprint).
    chunk = cache / "chunks" / "00000" / "000001.parquet"
    original = chunk.read_bytes()
    chunk.write_bytes(original[:50])
    repaired = repair_cache(str(cache), tokenizer=str(tokenizer_file), chat_template=TEMPLATE)
    assert repaired.repaired == [str(chunk)] and chunk.read_bytes() == original


def test_a_bad_prompt_record_is_named_by_file_and_line(tmp_path, tokenizer_file):
    source = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "1 + 2"}, {"question": "1 + 2"}]
    source.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(BadInputError, match=r"prompts\.jsonl:2: no prompt text or chat messages in its 'prompt'"):
        build_cache([str(source)], str(tmp_path / "a"), processor=PromptProcessor(str(tokenizer_file)), progress=False)
    # A tokenizer.json carries no chat template: text prompts need none, a chat prompt is a bad record.
    source.write_text(json.dumps({"prompt": "1 + 2"}) + "\n" + json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(BadInputError, match=r"prompts\.jsonl:2: the record's prompt is chat messages, but"):
        build_cache([str(source)], str(tmp_path / "b"), processor=PromptProcessor(str(tokenizer_file)), progress=False)
