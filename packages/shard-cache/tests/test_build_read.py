import importlib.util
import itertools
import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from shard_cache import (
    BuildMetrics,
    CacheMismatchError,
    build_cache,
    inspect_cache,
    open_cache,
    verify_cache,
)

SHARD_SIZES = (23, 41, 9)  # unequal, so shards drop out of the round-robin at different rounds
CHUNK = 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tools):
    root = tmp_path_factory.mktemp("corpus")
    shard_docs = [tools.make_docs(n, seed=s) for s, n in enumerate(SHARD_SIZES)]
    for s, docs in enumerate(shard_docs):
        tools.write_jsonl(root / f"part-{s}.jsonl", docs)
    return root, shard_docs


@pytest.fixture(scope="module")
def built(corpus, tokenizer_path, tmp_path_factory):
    root, shard_docs = corpus
    out = tmp_path_factory.mktemp("built") / "cache"
    seen: list[BuildMetrics] = []
    result = build_cache(
        [str(root / "part-{0..2}.jsonl")],
        str(out),
        tokenizer=str(tokenizer_path),
        chunk_size=CHUNK,
        progress=False,
        metrics_callback=seen.append,
    )
    return out, shard_docs, result, seen


def test_chunks_read_with_plain_pyarrow_equal_tokenizers_output(built, tokenizer, tools):
    out, shard_docs, result, _ = built
    ledger = json.loads((out / "ledger.json").read_text())
    rows = []
    for shard, chunk in ledger["order"]:
        table = pq.read_table(out / "chunks" / f"{shard:05d}" / f"{chunk:06d}.parquet")
        rows.extend(table.column("input_ids").to_pylist())
    expected = tools.reference_ids(tokenizer, tools.round_robin_docs(shard_docs, CHUNK))
    assert rows == expected
    assert result.docs == sum(SHARD_SIZES) and result.tokens == sum(map(len, expected))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert all(row.count(eos) == 1 and row[-1] == eos for row in rows)


def test_round_robin_global_order_with_exhausted_shards(built):
    out, _, _, _ = built
    order = [tuple(p) for p in json.loads((out / "ledger.json").read_text())["order"]]
    # 23, 41, 9 docs in chunks of 5 -> 5, 9, 2 chunks
    expected = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    expected += [(s, r) for r in range(2, 9) for s, n in ((0, 5), (1, 9)) if r < n]
    assert order == expected


def test_token_windows_and_documents_match_a_numpy_reference(built, tokenizer, tools):
    out, shard_docs, _, _ = built
    expected_docs = tools.reference_ids(tokenizer, tools.round_robin_docs(shard_docs, CHUNK))
    stream = np.concatenate([np.array(ids) for ids in expected_docs])
    reader = open_cache(str(out))
    windows = reader.token_windows(16)
    total = len(stream) // 16
    assert windows.final_num_examples() == total == windows.num_examples_available()
    indices = np.array([total - 1, 0, 7, 3, 7])
    batch = windows.get_batch(indices)
    assert batch.dtype == np.int32 and batch.shape == (5, 16)
    np.testing.assert_array_equal(batch, stream[: total * 16].reshape(total, 16)[indices])
    docs = reader.documents()
    assert [d.tolist() for d in docs.get([0, 12, sum(SHARD_SIZES) - 1])] == [expected_docs[i] for i in (0, 12, -1)]
    with pytest.raises(IndexError, match="does not have it"):
        windows.get_batch([total])


def test_reading_does_not_import_pandas(built):
    """pyarrow's to_numpy imports pandas on its first call: seconds of a run's start, before the first batch."""
    if importlib.util.find_spec("pandas") is None:
        pytest.skip("pandas is not installed here, so nothing could import it")
    code = (
        "import sys; from shard_cache import open_cache; reader = open_cache(sys.argv[1]); "
        "batch = reader.token_windows(16).get_batch([0, 3]); docs = reader.documents().get([0, 5]); "
        "print(int(batch.sum()), sum(len(d) for d in docs), 'pandas' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(built[0])], capture_output=True, text=True, check=True)
    tokens, doc_tokens, pandas_imported = out.stdout.split()
    assert int(tokens) > 0 and int(doc_tokens) > 0
    assert pandas_imported == "False"


def test_metrics_callback_inspect_and_verify(built):
    out, _, result, seen = built
    assert seen and seen[-1].docs == result.docs and seen[-1].tokens == result.tokens
    assert seen[-1].shards_done == seen[-1].shards_total == 3
    assert all(a.docs <= b.docs for a, b in itertools.pairwise(seen))
    metrics = seen[-1].as_dict()
    assert metrics["preprocessing/docs"] == float(result.docs)
    assert metrics["preprocessing/tokens"] == float(result.tokens)
    assert metrics["preprocessing/shards_finished"] == 3.0 and metrics["preprocessing/tokens_per_second"] > 0
    assert metrics["preprocessing/nodes"] == 1.0  # one host (this process) tokenized every shard
    summary = inspect_cache(str(out))
    assert summary["finished"] and summary["chunks"] == 16 and summary["docs"] == sum(SHARD_SIZES)
    report = verify_cache(str(out))
    assert report.ok and report.chunks_checked == 16


def test_verify_detects_a_corrupted_chunk(built, tmp_path):
    import shutil

    out, _, _, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    victim = copy / "chunks" / "00001" / "000003.parquet"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    report = verify_cache(str(copy))
    assert not report.ok and any("000003.parquet: sha256 differs" in p for p in report.problems)


def test_finished_cache_is_found_not_rebuilt_and_settings_are_checked(built, corpus, tokenizer_path):
    out, _, result, _ = built
    root, _ = corpus
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = build_cache([str(root / "part-{0..2}.jsonl")], str(out), tokenizer=str(tokenizer_path), chunk_size=CHUNK)
    assert again.docs == result.docs
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    with pytest.raises(CacheMismatchError, match="'chunk_size' was 5, now 6"):
        build_cache([str(root / "part-{0..2}.jsonl")], str(out), tokenizer=str(tokenizer_path), chunk_size=6)


@pytest.mark.parametrize("readers", [2, 3, 4])
def test_any_number_of_readers_yields_the_single_reader_order(built, readers):
    out, _, _, _ = built
    batch_size = 12
    single = list(open_cache(str(out)).token_windows(8).iter_batches(batch_size))
    assert len(single) >= 3
    per_process = []
    for p in range(readers):
        reader = open_cache(str(out))
        windows = reader.token_windows(8)
        per_process.append(list(windows.iter_batches(batch_size, process_index=p, process_count=readers)))
        wanted = set()
        for b in range(len(single)):
            local = np.arange(b * batch_size, (b + 1) * batch_size)[
                p * batch_size // readers : (p + 1) * batch_size // readers
            ]
            wanted |= windows.chunks_needed(local)
        assert set(reader.chunks_loaded) == wanted  # each reader loads only the chunks it needs
    for b, global_batch in enumerate(single):
        np.testing.assert_array_equal(np.concatenate([batches[b] for batches in per_process]), global_batch)


def test_shuffles_are_seeded_permutations(built):
    out, _, _, _ = built
    windows = open_cache(str(out)).token_windows(8)
    total = windows.final_num_examples()
    base = windows.get_batch(np.arange(total))
    shuffled = windows.shuffled(seed=3)
    order = shuffled.get_batch(np.arange(total))
    # a permutation of the examples: same multiset of rows, not the same order
    assert sorted(map(tuple, order.tolist())) == sorted(map(tuple, base.tolist()))
    assert not np.array_equal(order, base)
    again = open_cache(str(out)).token_windows(8).shuffled(seed=3)
    np.testing.assert_array_equal(order, again.get_batch(np.arange(total)))
    assert not np.array_equal(order, windows.shuffled(seed=4).get_batch(np.arange(total)))
    second_epoch = shuffled.get_batch(np.arange(total, 2 * total))  # another permutation of the same examples
    assert sorted(map(tuple, second_epoch.tolist())) == sorted(map(tuple, base.tolist()))
    assert not np.array_equal(second_epoch, order)
    era_view = windows.era_shuffled(seed=3, era_length=10, spread=4)
    examples = era_view.example_indices(np.arange(total))
    np.testing.assert_array_equal(np.sort(examples), np.arange(total))  # each example once
    np.testing.assert_array_equal(era_view.get_batch(np.arange(total)), base[examples])
    for u, (begin, end) in enumerate(itertools.pairwise(era_view.shuffle.era_starts())):
        # era u of the order draws from the stream's eras u - 3 ... u only
        drawn = examples[begin:end]
        assert begin == end or (u - 3) * 10 <= drawn.min() <= drawn.max() < (u + 1) * 10


def counting_processor(tokenizer_path, log_path):
    """The tokenizer processor, appending a line to `log_path` each time a process unpickles it."""
    from shard_cache import TokenizerProcessor

    class CountingProcessor(TokenizerProcessor):
        def __setstate__(self, state):
            self.__dict__.update(state)
            with open(log_path, "a") as log:
                log.write("loaded\n")

    return CountingProcessor(str(tokenizer_path))


def test_each_worker_deserialises_the_processor_once_per_build(tmp_path, tokenizer_path, tokenizer, tools, ray_cluster):
    docs = tools.make_docs(64, seed=21)
    for s in range(8):
        tools.write_jsonl(tmp_path / f"in-{s}.jsonl", docs[s::8])
    log = tmp_path / "loads.txt"
    result = build_cache(
        [str(tmp_path / "in-*.jsonl")],
        str(tmp_path / "cache"),
        processor=counting_processor(tokenizer_path, log),
        chunk_size=4,
        num_workers=2,
        progress=False,
        in_process=False,
    )
    assert result.shards == 8 and result.docs == 64
    loads = log.read_text().count("loaded")
    # one per worker process that ran a shard: 2 here, a few more if Ray handed shards to spare idle workers
    assert 1 <= loads <= 4, f"{loads} deserialisations for 8 shards on 2 workers: the processor is not kept warm"
    got = [d.tolist() for d in open_cache(str(tmp_path / "cache")).documents().get(range(64))]
    assert sorted(got) == sorted(tools.reference_ids(tokenizer, docs))
