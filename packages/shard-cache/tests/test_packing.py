"""Packed sequences: the packing plan's invariants, and packed examples checked against the cache read with pyarrow."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from shard_cache import (
    PackedSequences,
    PromptCompletionProcessor,
    TokenizerProcessor,
    build_cache,
    open_cache,
    plan_packs,
    process_slice,
)

SEQ_LEN = 48


def test_plan_packs_places_every_token_once_within_seq_len():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 90, 300)
    for rule in ("truncate", "split", "drop"):
        plan, stats = plan_packs(lengths, SEQ_LEN, long_documents=rule, max_segments=5)
        assert plan_packs(lengths, SEQ_LEN, long_documents=rule, max_segments=5)[0][3].tolist() == plan[3].tolist()
        covered: dict[int, list[tuple[int, int]]] = {}
        for pieces in plan:
            assert 1 <= len(pieces) <= 5 and int((pieces[:, 2] - pieces[:, 1]).sum()) <= SEQ_LEN
            assert pieces[:, 0].tolist() == sorted(pieces[:, 0].tolist())  # document order within a sequence
            for doc, start, stop in pieces.tolist():
                covered.setdefault(doc, []).append((start, stop))
        long = lengths > SEQ_LEN
        for doc, length in enumerate(lengths.tolist()):
            spans = sorted(covered.get(doc, []))
            if rule == "drop" and length > SEQ_LEN:
                assert not spans
            elif rule == "split":
                assert spans == [(s, min(s + SEQ_LEN, length)) for s in range(0, length, SEQ_LEN)]
            else:
                assert spans == [(0, min(length, SEQ_LEN))]
        assert stats.documents == 300 and stats.sequences == len(plan)
        assert stats.tokens + stats.padding == stats.sequences * SEQ_LEN
        assert stats.truncated_documents == (int(long.sum()) if rule == "truncate" else 0)
        assert stats.dropped_documents == (int(long.sum()) if rule == "drop" else 0)
        if rule == "truncate":
            assert stats.truncated_tokens == int((lengths[long] - SEQ_LEN).sum())
    # First-fit decreasing leaves little room: far fewer sequences than one per document.
    assert plan_packs(lengths, SEQ_LEN)[1].padding < 0.1 * SEQ_LEN * len(plan_packs(lengths, SEQ_LEN)[0])
    one_each, stats = plan_packs(lengths, SEQ_LEN, max_segments=1)  # padded, unpacked examples
    assert len(one_each) == 300 and stats.sequences == 300
    with pytest.raises(ValueError, match="long_documents must be one of"):
        plan_packs(lengths, SEQ_LEN, long_documents="wrap")


def _chunks_in_global_order(cache: Path) -> list[list[dict]]:
    """The rows of each chunk, read with plain pyarrow, in the cache's round-robin global order."""
    shards = sorted((cache / "chunks").iterdir())
    per_shard = [sorted(s.glob("*.parquet")) for s in shards]
    order = []
    for r in range(max(len(c) for c in per_shard)):
        order += [chunks[r] for chunks in per_shard if r < len(chunks)]
    return [pq.read_table(p).to_pylist() for p in order]


def _check_against_rows(view: PackedSequences, chunks: list[list[dict]], pad_id: int) -> None:
    """Every packed sequence holds whole rows of one chunk (truncated to seq_len), with the right ids and masks."""
    index = 0
    for rows in chunks:
        expected = Counter(tuple(r["input_ids"][:SEQ_LEN]) for r in rows)
        masks = {tuple(r["input_ids"][:SEQ_LEN]): r.get("loss_mask", [True] * len(r["input_ids"])) for r in rows}
        found: Counter = Counter()
        while sum(found.values()) < len(rows):
            batch = view.get_batch([index])
            ids, seg, pos, loss = (batch[k][0] for k in ("input_ids", "segment_ids", "positions", "loss_mask"))
            assert np.all(ids[seg == -1] == pad_id) and not loss[seg == -1].any()
            for s in range(seg.max() + 1):
                where = np.flatnonzero(seg == s)
                assert where.tolist() == list(range(where[0], where[-1] + 1))  # one contiguous piece
                tokens = tuple(ids[where].tolist())
                assert tokens in expected, "a packed segment is not a row of its chunk"
                found[tokens] += 1
                assert pos[where].tolist() == list(range(len(where)))
                stored = masks[tokens]
                assert loss[where].tolist() == [*stored[1 : len(where)], False]  # predicting t+1; none across
            index += 1
        assert found == expected
    with pytest.raises(IndexError):
        view.get_batch([index])


@pytest.fixture(scope="module")
def sft_cache(tmp_path_factory, tokenizer_path, tools) -> Path:
    """A prompt/completion cache over two files, some records longer than SEQ_LEN."""
    root = tmp_path_factory.mktemp("sft")
    docs = tools.make_docs(90, seed=4)
    files = []
    for shard in range(2):
        path = root / f"part{shard}.jsonl"
        lines = [{"prompt": d[:30] + "\n", "completion": d[30:]} for d in docs[shard::2]]
        path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
        files.append(str(path))
    processor = PromptCompletionProcessor(str(tokenizer_path))
    build_cache(files, str(root / "cache"), processor=processor, chunk_size=16, progress=False)
    return root / "cache"


def test_packed_sft_examples_match_the_cache(sft_cache):
    view = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN, pad_id=7)
    chunks = _chunks_in_global_order(sft_cache)
    _check_against_rows(view, chunks, pad_id=7)
    stats = view.stats()
    lengths = [len(r["input_ids"]) for rows in chunks for r in rows]
    assert stats.documents == len(lengths) == 90
    assert stats.truncated_documents == sum(n > SEQ_LEN for n in lengths) > 0
    assert stats.sequences == view.num_examples_available() < 90


def test_packed_order_is_the_same_for_any_reader_and_process_count(sft_cache):
    first = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN).shuffled(seed=5)
    second = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN).shuffled(seed=5)
    indices = np.arange(3 * 8, 4 * 8) % len(first) + len(first)  # the second epoch's order
    whole = first.get_batch(indices)
    halves = [second.get_batch(process_slice(indices, p, 2)) for p in range(2)]
    for key, value in whole.items():
        assert value.shape == (8, SEQ_LEN)
        np.testing.assert_array_equal(value, np.concatenate([h[key] for h in halves]))
    other = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN).shuffled(seed=6).get_batch(indices)
    assert not np.array_equal(other["input_ids"], whole["input_ids"])
    plain = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN)
    reader = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN)
    batches = list(reader.iter_batches(4, process_index=1, process_count=2))
    assert len(batches) == plain.num_examples_available() // 4
    np.testing.assert_array_equal(batches[1]["input_ids"], plain.get_batch([6, 7])["input_ids"])


def test_era_shuffled_packs_are_each_pack_once_in_an_order_every_reader_agrees_on(sft_cache):
    plain = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN)
    total = plain.num_examples_available()
    view = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN).era_shuffled(seed=5, era_length=4, spread=3)
    order = view.example_indices(np.arange(total))
    np.testing.assert_array_equal(np.sort(order), np.arange(total))  # the packs of the cache, each once
    whole = view.get_batch(np.arange(total))
    expected = plain.get_batch(order)
    for key, value in whole.items():
        np.testing.assert_array_equal(value, expected[key])
    with pytest.raises(IndexError):
        view.get_batch([total])
    again = PackedSequences(open_cache(str(sft_cache)), SEQ_LEN).era_shuffled(seed=5, era_length=4, spread=3)
    indices = np.arange(8, 16)
    halves = [again.get_batch(process_slice(indices, p, 2))["input_ids"] for p in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), whole["input_ids"][8:16])


def test_pretraining_packing_splits_long_documents(tmp_path, tokenizer_path, tools):
    source = tools.write_jsonl(tmp_path / "text.jsonl", tools.make_docs(30, seed=8))
    build_cache([str(source)], str(tmp_path / "cache"), processor=TokenizerProcessor(str(tokenizer_path)))
    view = PackedSequences(open_cache(str(tmp_path / "cache")), SEQ_LEN, long_documents="split")
    (rows,) = _chunks_in_global_order(tmp_path / "cache")
    batch = view.get_batch(np.arange(view.num_examples_available()))
    pieces: list[list[int]] = []
    for ids, seg, loss in zip(batch["input_ids"], batch["segment_ids"], batch["loss_mask"], strict=True):
        for s in range(seg.max() + 1):
            where = seg == s
            pieces.append(ids[where].tolist())
            assert loss[where].tolist() == [True] * (int(where.sum()) - 1) + [False]  # every next token counts
    expected = [r["input_ids"][i : i + SEQ_LEN] for r in rows for i in range(0, len(r["input_ids"]), SEQ_LEN)]
    assert sorted(pieces) == sorted(expected) and view.stats().truncated_documents == 0
