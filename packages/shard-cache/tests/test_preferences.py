"""Preference pairs: the cache's rows against plain tokenizers and transformers' apply_chat_template, read back with
plain pyarrow; bad records by file and line; the PreferencePairs view against the rows it reads."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from shard_cache import (
    BadInputError,
    PreferenceChatProcessor,
    PreferencePairs,
    PreferenceProcessor,
    build_cache,
    open_cache,
    repair_cache,
)
from shard_cache.records import BadRecord

# ChatML with generation tags (transformers needs them for assistant masks); the tokenizer directory carries the
# same template without them, so the processor finds the spans by incremental rendering there.
CHATML = """\
{%- for message in messages %}
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
CHATML_PLAIN = CHATML.replace("{%- generation %}", "").replace("{% endgeneration %}", "")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["the", "cache", "shard", "token", "reader", "ray", "value", "index", "chunk", "naïve", "12", "?", "!", "🙂"]


def _text(rng: random.Random, low: int = 1, high: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def pairs(count: int, seed: int) -> list[dict]:
    """Conversational preference records: a 1-2 round prompt (earlier assistant turns included), two answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = []
        for _ in range(rng.randint(1, 2)):
            prompt += [{"role": "user", "content": _text(rng)}, {"role": "assistant", "content": _text(rng)}]
        prompt = prompt[:-1]  # ends with the user's turn
        out.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": _text(rng)}],
                "rejected": [{"role": "assistant", "content": _text(rng)}],
            }
        )
    return out


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """An HF tokenizer directory: a byte-level BPE trained here, with CHATML_PLAIN as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(5)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([_text(rng, 5, 30) for _ in range(300)], trainer)
    directory = tmp_path_factory.mktemp("pref-tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_PLAIN,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def cache_rows(cache: Path) -> list[dict]:
    """Every row of a cache, read with plain pyarrow, chunk file by chunk file."""
    rows = []
    for path in sorted((cache / "chunks").rglob("*.parquet")):
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def split_row(row: dict) -> tuple[tuple[list, list], tuple[list, list]]:
    """((chosen ids, chosen mask), (rejected ids, rejected mask)) of a row, by its is_rejected column."""
    sides = np.asarray(row["is_rejected"])
    ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
    return (ids[~sides].tolist(), mask[~sides].tolist()), (ids[sides].tolist(), mask[sides].tolist())


def test_text_pairs_store_both_sequences_with_response_masks(tmp_path, chat_tokenizer):
    from tokenizers import Tokenizer

    rng = random.Random(1)
    records = [{"prompt": _text(rng) + "\n", "chosen": _text(rng), "rejected": _text(rng)} for _ in range(30)]
    files = [write_jsonl(tmp_path / f"p{i}.jsonl", records[i::2]) for i in range(2)]
    result = build_cache(
        [str(f) for f in files],
        str(tmp_path / "cache"),
        processor=PreferenceProcessor(str(chat_tokenizer)),
        chunk_size=8,
        progress=False,
    )
    assert result.docs == 30
    # A damaged chunk is rebuilt from the records with the same bytes: the processor comes from the fingerprint.
    chunk = tmp_path / "cache" / "chunks" / "00001" / "000000.parquet"
    original = chunk.read_bytes()
    chunk.write_bytes(original[:100])
    assert repair_cache(str(tmp_path / "cache"), tokenizer=str(chat_tokenizer)).repaired == [str(chunk)]
    assert chunk.read_bytes() == original
    tok = Tokenizer.from_file(str(chat_tokenizer / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    rows = cache_rows(tmp_path / "cache")
    assert set(rows[0]) == {"input_ids", "loss_mask", "is_rejected"}
    order = records[0::2] + records[1::2]  # cache_rows reads shard 0's chunks, then shard 1's
    for row, record in zip(rows, order, strict=True):
        prompt = tok.encode(record["prompt"], add_special_tokens=False).ids  # ends in a newline: its own tokens
        for (ids, mask), response in zip(split_row(row), (record["chosen"], record["rejected"]), strict=True):
            answer = tok.encode(response, add_special_tokens=False).ids
            assert ids == [*prompt, *answer, eos]
            assert mask == [False] * len(prompt) + [True] * (len(answer) + 1)


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


def reference_sequence(hf_tokenizer, prompt: list[dict], response: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids of prompt + response, and its assistant mask with the prompt's own turns cleared."""
    done = hf_tokenizer.apply_chat_template(
        prompt + response, chat_template=CHATML, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    head = hf_tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    mask = [0] * len(head) + list(done["assistant_masks"][len(head) :])
    return list(done["input_ids"]), mask


@pytest.mark.parametrize("template", [None, CHATML], ids=["incremental", "generation-tags"])
def test_chat_pairs_equal_apply_chat_template(tmp_path, chat_tokenizer, hf_tokenizer, template):
    records = pairs(40, seed=3)
    # Half in Levanter's form (two whole conversations, the prompt implicit), half in TRL's (prompt + turns).
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in records[::2]]
    explicit = [
        {"messages": r["prompt"], "chosen": r["chosen"][0]["content"], "rejected": r["rejected"]} for r in records[1::2]
    ]
    source = write_jsonl(tmp_path / "prefs.jsonl", [x for pair in zip(implicit, explicit, strict=True) for x in pair])
    processor = PreferenceChatProcessor(str(chat_tokenizer), chat_template=template)
    assert processor.chat.span_method == ("incremental" if template is None else "generation_tags")
    build_cache([str(source)], str(tmp_path / "cache"), processor=processor, chunk_size=16, progress=False)
    rows = cache_rows(tmp_path / "cache")
    assert len(rows) == len(records)
    chunk = tmp_path / "cache" / "chunks" / "00000" / "000001.parquet"
    original = chunk.read_bytes()
    chunk.write_bytes(original[:100])
    repaired = repair_cache(str(tmp_path / "cache"), tokenizer=str(chat_tokenizer), chat_template=template)
    assert repaired.repaired == [str(chunk)] and chunk.read_bytes() == original
    for row, record in zip(rows, records, strict=True):
        for (ids, mask), side in zip(split_row(row), ("chosen", "rejected"), strict=True):
            expected_ids, expected_mask = reference_sequence(hf_tokenizer, record["prompt"], record[side])
            assert ids == expected_ids
            assert [int(m) for m in mask] == expected_mask and any(mask)


BAD = [
    (None, {"prompt": "q\n", "chosen": "the cache", "rejected": "the ray"}),
    ("missing_field", {"prompt": "q\n", "chosen": "the cache"}),
    ("empty", {"prompt": "q\n", "chosen": "  ", "rejected": "the ray"}),
    ("not_a_string", {"prompt": "q\n", "chosen": 12, "rejected": "the ray"}),
    ("malformed_json", "{not json"),
    (None, {"prompt": "", "chosen": "the index", "rejected": "the chunk"}),
    ("no_distinct_response", {"prompt": "q\n", "chosen": "the ray", "rejected": "the ray"}),
]


def test_bad_pairs_name_the_line_or_are_skipped_and_counted(tmp_path, chat_tokenizer):
    source = tmp_path / "bad.jsonl"
    source.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for _, r in BAD), encoding="utf-8")
    processor = PreferenceProcessor(str(chat_tokenizer))
    with pytest.raises(BadInputError) as info:
        build_cache([str(source)], str(tmp_path / "failed"), processor=processor, progress=False)
    assert str(info.value).startswith(f"{source}:2: no field 'rejected'") and "on_bad_input='skip'" in str(info.value)
    result = build_cache(
        [str(source)], str(tmp_path / "skipped"), processor=processor, on_bad_input="skip", progress=False
    )
    assert result.docs == 2 and result.skipped == {reason: 1 for reason, _ in BAD if reason}

    chat = PreferenceChatProcessor(str(chat_tokenizer))
    user = {"role": "user", "content": "hi"}
    cases = {
        "no_distinct_response": {"chosen": [user, {"role": "assistant", "content": "a"}]}
        | {"rejected": [user, {"role": "assistant", "content": "a"}]},
        "no_assistant_turn": {"messages": [user], "chosen": [user], "rejected": "fine"},
        "ambiguous_prompt": {"prompt": [user], "messages": [user], "chosen": "a", "rejected": "b"},
        "unknown_role": {"messages": [{"role": "wizard", "content": "x"}], "chosen": "a", "rejected": "b"},
        "bad_messages": {"messages": [user], "chosen": 3, "rejected": "b"},
    }
    for reason, record in cases.items():
        with pytest.raises(BadRecord) as bad:
            chat.prepare(record)
        assert bad.value.reason == reason, (reason, bad.value.message)
    # With the prompt given, equal responses are refused too, however each is written.
    for chosen, rejected in [("a", "a"), ("a", {"role": "assistant", "content": "a"}), ([user], [user])]:
        with pytest.raises(BadRecord) as bad:
            chat.prepare({"prompt": [user], "chosen": chosen, "rejected": rejected})
        assert bad.value.reason == "no_distinct_response", bad.value.message


def test_an_empty_prompt_scores_the_responses_from_their_second_token(tmp_path, chat_tokenizer):
    """An empty prompt is a pair of unconditioned responses: every response token and the EOS are targets, and the
    first token, which nothing precedes, is scored by no prediction (as docs/dpo.md says)."""
    from tokenizers import Tokenizer

    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "", "chosen": "the cache", "rejected": "ray index"}])
    build_cache(
        [str(source)], str(tmp_path / "cache"), processor=PreferenceProcessor(str(chat_tokenizer)), progress=False
    )
    tok = Tokenizer.from_file(str(chat_tokenizer / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (row,) = cache_rows(tmp_path / "cache")
    view = PreferencePairs(open_cache(str(tmp_path / "cache")), 8, pad_id=0).get_batch(np.arange(1))
    for (ids, mask), response, prefix in zip(
        split_row(row), ("the cache", "ray index"), ("", "rejected_"), strict=True
    ):
        answer = tok.encode(response, add_special_tokens=False).ids
        assert ids == [*answer, eos] and mask == [True] * (len(answer) + 1)
        n = len(ids)
        assert view[prefix + "loss_mask"][0].tolist() == [True] * (n - 1) + [False] * (8 - n + 1)

    chat = PreferenceChatProcessor(str(chat_tokenizer))
    user = {"role": "user", "content": "hi"}
    given = chat.prepare({"prompt": [], "chosen": [user, {"role": "assistant", "content": "a"}], "rejected": "b"})
    implicit = chat.prepare(
        {"chosen": [user, {"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}
    )
    assert given.chosen == implicit.chosen and given.rejected == implicit.rejected


def test_pairs_view_serves_padded_rows_with_next_token_masks(tmp_path, chat_tokenizer):
    rng = random.Random(2)
    records = [
        {"prompt": _text(rng, 1, 3) + "\n", "chosen": _text(rng), "rejected": _text(rng, 6, 12)} for _ in range(20)
    ]
    source = write_jsonl(tmp_path / "p.jsonl", records)
    build_cache(
        [str(source)],
        str(tmp_path / "cache"),
        processor=PreferenceProcessor(str(chat_tokenizer)),
        chunk_size=6,
        progress=False,
    )
    rows = cache_rows(tmp_path / "cache")
    seq_len = 12
    view = PreferencePairs(open_cache(str(tmp_path / "cache")), seq_len, pad_id=7)
    assert view.final_num_examples() == 20
    batch = view.get_batch(np.arange(20))
    assert set(batch) == {"input_ids", "loss_mask", "rejected_input_ids", "rejected_loss_mask"}
    cut = 0
    for i, row in enumerate(rows):
        for (ids, targets), prefix in zip(split_row(row), ("", "rejected_"), strict=True):
            n = min(len(ids), seq_len)
            cut += len(ids) > seq_len
            assert batch[prefix + "input_ids"][i].tolist() == ids[:n] + [7] * (seq_len - n)
            # mask[t] says whether predicting token t + 1 counts: the target flags shifted left by one
            assert batch[prefix + "loss_mask"][i].tolist() == targets[1:n] + [False] * (seq_len - n + 1)
    stats = view.stats()
    assert stats.pairs == 20 and stats.truncated_sequences == cut > 0
    shuffled = view.shuffled(seed=3).get_batch(np.arange(20))["rejected_input_ids"]
    assert sorted(map(tuple, shuffled.tolist())) == sorted(map(tuple, batch["rejected_input_ids"].tolist()))
    assert shuffled.tolist() != batch["rejected_input_ids"].tolist()
    era = view.era_shuffled(seed=3, era_length=4, spread=2)
    positions = era.example_indices(np.arange(20))
    assert sorted(positions.tolist()) == list(range(20))  # each pair once
    assert era.get_batch(np.arange(20))["input_ids"].tolist() == batch["input_ids"][positions].tolist()
