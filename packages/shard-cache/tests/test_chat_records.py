"""Chat and prompt/completion records: the cache's input_ids and loss_mask against transformers and plain pyarrow.

The tokenizer is a byte-level BPE trained here and saved as an HF tokenizer directory with a chat template; the
reference is transformers' own `apply_chat_template` (its `assistant_masks` for templates with generation tags).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shard_cache import (
    BadInputError,
    ChatProcessor,
    ChunkCorruptError,
    PromptCompletionProcessor,
    ShardCacheError,
    build_cache,
    open_cache,
    repair_cache,
)
from shard_cache.records import BadRecord

# ChatML as Qwen-style models write it: a default system prompt, loop controls, raise_exception.
CHATML = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message['role'] == 'system' %}{% continue %}{% endif %}
    {%- if message['role'] not in ['user', 'assistant', 'system'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# The same template without the generation tags: what most tokenizer_config.json files carry.
CHATML_PLAIN = CHATML.replace("{%- generation %}", "").replace("{% endgeneration %}", "")
# Llama-3 style: BOS from the tokenizer, trimmed contents, tool calls as JSON, tags on the assistant's text.
LLAMA3 = """\
{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}
        {%- if message.tool_calls is defined %}
            {{- message.tool_calls | tojson }}
        {%- else %}
            {{- message['content'] | trim }}
        {%- endif %}
        {{- '<|eot_id|>' }}
        {%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>"]
SPECIALS += ["<|end_header_id|>", "<|eot_id|>"]
WORDS = ["the", "cache", "shard", "token", "reader", "ray", "value", "index", "chunk", "order", "seed"]
WORDS += ["naïve", "café", "12", "345", "?", "!", ".", ",", "🙂", "über"]


def _text(rng: random.Random, low: int = 1, high: int = 12) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))
    return rng.choice(["", " ", "\n"]) + words + rng.choice(["", "", " ", "\n", "  \n"])


def conversations(count: int, seed: int, tools: bool) -> list[list[dict]]:
    """Synthetic conversations: optional system prompt, 1-3 rounds, now and then a tool call or a final user turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": _text(rng)})
            if tools and rng.random() < 0.15:
                call = {"name": "lookup", "arguments": {"query": _text(rng, 1, 3), "n": rng.randint(1, 9)}}
                messages.append({"role": "assistant", "tool_calls": [{"type": "function", "function": call}]})
                messages.append({"role": "user", "content": _text(rng)})
            messages.append({"role": "assistant", "content": _text(rng)})
        if rng.random() < 0.1:
            messages.append({"role": "user", "content": _text(rng)})
        out.append(messages)
    return out


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """An HF tokenizer directory: byte-level BPE trained here, special tokens, CHATML_PLAIN as its template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(7)
    corpus = [_text(rng, 5, 40) for _ in range(400)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": CHATML_PLAIN,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def hf_tokenizer(chat_tokenizer):
    """transformers' tokenizer for the same directory; skipped locally without transformers, a failure in CI."""
    try:
        import transformers
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Parity tests need transformers ({e}); CI installs the `parity` group (uv sync --all-groups).")
        pytest.skip(f"transformers not installed ({e}); `uv sync --all-groups` installs it")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(chat_tokenizer))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def cache_rows(cache: Path) -> list[dict]:
    """Every row of a cache, read with plain pyarrow, shard by shard and chunk by chunk."""
    rows = []
    for path in sorted((cache / "chunks").rglob("*.parquet")):
        rows.extend(pq.read_table(path).to_pylist())
    return rows


@pytest.mark.parametrize(
    ("template", "method", "tools"),
    [(None, "incremental", False), (LLAMA3, "generation_tags", True)],
    ids=["tokenizer-template", "llama3-tags"],
)
def test_chat_cache_equals_apply_chat_template(tmp_path, chat_tokenizer, hf_tokenizer, template, method, tools):
    convs = conversations(300, seed=11 if tools else 12, tools=tools)
    files = [write_jsonl(tmp_path / f"part{i}.jsonl", [{"messages": c} for c in convs[i::2]]) for i in range(2)]
    processor = ChatProcessor(str(chat_tokenizer), chat_template=template)
    assert processor.span_method == method
    result = build_cache([str(f) for f in files], str(tmp_path / "cache"), processor=processor, chunk_size=64)
    assert result.docs == len(convs) and not result.skipped

    rows = cache_rows(tmp_path / "cache")
    assert set(rows[0]) == {"input_ids", "loss_mask"}
    expected_order = convs[0::2] + convs[1::2]  # shard 0's conversations, then shard 1's
    tagged = CHATML if template is None else LLAMA3  # transformers needs the tags to compute assistant masks
    for row, conv in zip(rows, expected_order, strict=True):
        plain_ids = hf_tokenizer.apply_chat_template(conv, chat_template=template, tokenize=True, return_dict=False)
        reference = hf_tokenizer.apply_chat_template(
            conv, chat_template=tagged, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert row["input_ids"] == list(plain_ids) == list(reference["input_ids"])
        assert [int(m) for m in row["loss_mask"]] == list(reference["assistant_masks"])
        assert any(row["loss_mask"])


def test_prompt_completion_cache_masks_the_prompt(tmp_path, chat_tokenizer):
    from tokenizers import Tokenizer

    rng = random.Random(3)
    records = [{"prompt": _text(rng).strip() + "\n", "completion": _text(rng).strip()} for _ in range(40)]
    source = write_jsonl(tmp_path / "pc.jsonl", records)
    processor = PromptCompletionProcessor(str(chat_tokenizer), add_bos=True)
    build_cache([str(source)], str(tmp_path / "cache"), processor=processor, chunk_size=16)
    tok = Tokenizer.from_file(str(chat_tokenizer / "tokenizer.json"))
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|im_end|>")
    for row, record in zip(cache_rows(tmp_path / "cache"), records, strict=True):
        # The prompt ends in a newline, so its tokens and the completion's are those of each alone.
        prompt = tok.encode(record["prompt"], add_special_tokens=False).ids
        completion = tok.encode(record["completion"], add_special_tokens=False).ids
        assert row["input_ids"] == [bos, *prompt, *completion, eos]
        assert row["loss_mask"] == [False] * (1 + len(prompt)) + [True] * (len(completion) + 1)

    # A damaged chunk is rebuilt from the records with the same bytes: the processor comes from the fingerprint.
    chunk = tmp_path / "cache" / "chunks" / "00000" / "000001.parquet"
    original = chunk.read_bytes()
    chunk.write_bytes(original[:100])
    assert repair_cache(str(tmp_path / "cache"), tokenizer=str(chat_tokenizer)).repaired == [str(chunk)]
    assert chunk.read_bytes() == original


BAD_LINES = [
    (None, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cache"}]}),
    ("missing_role", {"messages": [{"content": "who am i"}, {"role": "assistant", "content": "ok"}]}),
    ("unknown_role", {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "ok"}]}),
    ("missing_content", {"messages": [{"role": "user"}, {"role": "assistant", "content": "ok"}]}),
    ("template_error", {"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "o"}]}),
    ("not_an_object", [1, 2]),
    ("no_assistant_turn", {"messages": [{"role": "user", "content": "anyone?"}]}),
    ("missing_field", {"conversation": []}),
    (None, {"messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "the shard"}]}),
]


def test_bad_chat_records_name_the_line_or_are_skipped_and_counted(tmp_path, chat_tokenizer):
    source = write_jsonl(tmp_path / "chats.jsonl", [record for _, record in BAD_LINES])
    processor = ChatProcessor(str(chat_tokenizer))
    with pytest.raises(BadInputError) as info:
        build_cache([str(source)], str(tmp_path / "failed"), processor=processor, progress=False)
    message = str(info.value)
    assert message.startswith(f"{source}:2: message 0 has no 'role'") and "on_bad_input='skip'" in message
    assert "Traceback" not in message

    result = build_cache(
        [str(source)], str(tmp_path / "skipped"), processor=processor, on_bad_input="skip", progress=False
    )
    assert result.docs == 2
    assert result.skipped == {reason: 1 for reason, _ in BAD_LINES if reason}

    for reason, record in BAD_LINES[1:-1]:  # each message says what is wrong
        if isinstance(record, dict):
            with pytest.raises(BadRecord) as bad:
                processor.prepare(record)
            assert bad.value.reason == reason
    with pytest.raises(BadRecord, match="the role 'wizard', which is not one of"):
        processor.prepare(BAD_LINES[2][1])
    with pytest.raises(BadRecord, match=r"failed on it \(TypeError"):
        processor.prepare(BAD_LINES[4][1])


def test_template_errors_and_template_sources(tmp_path, chat_tokenizer):
    raising = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(BadRecord, match="roles must alternate"):
        ChatProcessor(str(chat_tokenizer), chat_template=raising).prepare(BAD_LINES[0][1])
    with pytest.raises(ShardCacheError, match=r"not a valid jinja template: .*template line 1"):
        ChatProcessor(str(chat_tokenizer), chat_template="{% for m in messages %}")
    # A template that renders the last turn differently cannot be read incrementally: say so, name the fix.
    last_only = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}<|im_end|>{% endif %}{% endfor %}"
    two_turns = {"messages": [*BAD_LINES[0][1]["messages"], *BAD_LINES[-1][1]["messages"]]}
    with pytest.raises(BadRecord, match=r"\{% generation %\}") as info:
        ChatProcessor(str(chat_tokenizer), chat_template=last_only).prepare(two_turns)
    assert info.value.reason == "template_not_incremental"

    # chat_template.jinja and named templates take precedence over tokenizer_config.json, as in transformers.
    directory = tmp_path / "tok"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((chat_tokenizer / name).read_bytes())
    (directory / "chat_template.jinja").write_text(LLAMA3, encoding="utf-8")
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "chatml.jinja").write_text(CHATML, encoding="utf-8")
    assert ChatProcessor(str(directory)).template.source == LLAMA3
    assert ChatProcessor(str(directory), chat_template="chatml").template.source == CHATML
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((chat_tokenizer / "tokenizer.json").read_bytes())
    with pytest.raises(ShardCacheError, match=r"no chat template: .*Pass chat_template="):
        ChatProcessor(str(bare))


def test_mask_user_turns_off_trains_on_everything(chat_tokenizer):
    processor = ChatProcessor(str(chat_tokenizer), mask_user_turns=False)
    prepared = processor.prepare(BAD_LINES[0][1])
    batch = processor([prepared]).to_pylist()[0]
    assert all(batch["loss_mask"]) and len(batch["input_ids"]) > 10
    assert processor.fingerprint()["mask_user_turns"] is False


def test_chat_build_from_the_command_line(tmp_path, chat_tokenizer, ray_cluster, capsys):
    from shard_cache.cli import main

    source = write_jsonl(tmp_path / "chats.jsonl", [record for _, record in BAD_LINES])
    (tmp_path / "llama3.jinja").write_text(LLAMA3, encoding="utf-8")
    args = ["build", str(source), "--tokenizer", str(chat_tokenizer), "--record-format", "chat", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "failed"), "--ray-address", ray_cluster]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {source}:2: message 0 has no 'role'") and "Traceback" not in err
    args += ["--chat-template", str(tmp_path / "llama3.jinja"), "--on-bad-input", "skip"]
    assert main([*args, "--out", str(tmp_path / "cache")]) == 0
    assert "3 documents" in capsys.readouterr().out  # under this template a list content renders
    rows = cache_rows(tmp_path / "cache")
    bos = json.loads((chat_tokenizer / "tokenizer.json").read_text())["added_tokens"][3]
    assert bos["content"] == "<|begin_of_text|>" and rows[0]["input_ids"][0] == bos["id"]  # the Llama-3 template

    # The checked read gives loss_mask with input_ids; a damaged chunk is named, then repaired to the same bytes
    # (its records go through the processor's prepare again, skipped lines included).
    cache = str(tmp_path / "cache")
    documents = open_cache(cache)
    for i, row in enumerate(rows):
        assert documents.document(i).tolist() == row["input_ids"]
        assert documents.document_column(i, "loss_mask").tolist() == row["loss_mask"]
    chunk = tmp_path / "cache" / "chunks" / "00000" / "000000.parquet"
    original = chunk.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01
    chunk.write_bytes(bytes(damaged))
    with pytest.raises(ChunkCorruptError, match="CRC-32C"):
        open_cache(cache).document_column(0, "loss_mask")
    assert main(["verify", cache, "--no-progress"]) == 1
    capsys.readouterr()
    # The directory's own template is not the one the cache was built with: refused, nothing written.
    assert main(["verify", cache, "--repair", "--tokenizer", str(chat_tokenizer), "--no-progress"]) == 2
    assert "not the one this cache was built with" in capsys.readouterr().err and chunk.read_bytes() == damaged
    template = str(tmp_path / "llama3.jinja")
    repair = ["verify", cache, "--repair", "--tokenizer", str(chat_tokenizer), "--chat-template", template]
    assert main([*repair, "--no-progress"]) == 0
    assert f"repaired: {chunk}" in capsys.readouterr().err and chunk.read_bytes() == original
    chunk.write_bytes(bytes(damaged))
    repairing = open_cache(cache, repair_with=ChatProcessor(str(chat_tokenizer), chat_template=LLAMA3))
    assert repairing.document_column(len(rows) - 1, "loss_mask").tolist() == rows[-1]["loss_mask"]
    assert chunk.read_bytes() == original
