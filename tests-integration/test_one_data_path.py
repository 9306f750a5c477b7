"""A single source is read as a mixture of one, and its batches are exactly those of the single-source order.

The caches are built by the app's own `prepare_data` (Ray, the real builder) from jsonl files; the reference
reads them back with plain pyarrow (the ledger's chunk order, the documents' ids, windows of seq_len) and orders
the examples as the single-source path always has: position p of the run is example p of the cache's windows,
of their seeded full permutation or of their seeded eras (shard-cache's own orders, with the run's seed), and
epochs start over at the cache's end. Every step's global batch must equal the reference for 1, 2 and 4
processes, packed prompt/completion examples too, and the evaluation must read the validation cache in order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import shard_cache
from lm_train.config import load_train_config
from lm_train.config.mixture_keys import SINGLE_SOURCE
from lm_train.data.batches import ProcessSlice, TrainBatches
from lm_train.data.caches import prepare_data
from lm_train.data.sft_data import example_fields, example_view
from lm_train.run.evaluation import Evaluator
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).parents[1] / "configs" / "gpt2_nano.yaml"
SEQ, BATCH, SEED, STEPS = 16, 8, 5, 12
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def _docs(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"doc {seed}-{i}: " + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) for i in range(count)]


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three training files, a validation file, prompt/completion records, and a tokenizer trained on the text."""
    root = tmp_path_factory.mktemp("one-data-path")
    tokenizer = root / "tokenizer.json"
    shard_cache.train_tokenizer(_docs(200, seed=1), 300, save_path=tokenizer)
    train = [_write(root / f"train-{k}.jsonl", [{"text": d} for d in _docs(6, seed=10 + k)]) for k in range(3)]
    validation = _write(root / "validation.jsonl", [{"text": d} for d in _docs(20, seed=20)])
    pairs = [{"prompt": p, "completion": c} for p, c in zip(_docs(40, seed=30), _docs(40, seed=31), strict=True)]
    records = _write(root / "pairs.jsonl", pairs)
    return root, str(tokenizer), train, validation, records


def _config(corpus, *overrides: str):
    root, tokenizer, train, validation, _ = corpus
    data = ["--data.builtin", "null", "--data.tokenizer", tokenizer, "--data.cache_dir", str(root / "cache")]
    data += ["--data.train_urls", json.dumps(train), "--data.validation_urls", json.dumps([validation])]
    data += ["--data.chunk_size", "4", "--model.seq_len", str(SEQ), "--trainer.train_batch_size", str(BATCH)]
    data += ["--trainer.seed", str(SEED), "--model.hidden_dim", "32", "--model.num_heads", "2"]
    config, _ = load_train_config([CONFIG], [*data, *overrides])
    return config


def _pyarrow_documents(cache: str) -> list[list[int]]:
    """The cache's documents as plain pyarrow reads them, in the ledger's global chunk order."""
    order = json.loads((Path(cache) / "ledger.json").read_text())["order"]
    tables = [pq.read_table(Path(cache) / "chunks" / f"{s:05d}" / f"{c:06d}.parquet") for s, c in order]
    return [doc for table in tables for doc in table.column("input_ids").to_pylist()]


def _pyarrow_windows(cache: str) -> np.ndarray:
    """Consecutive windows of SEQ tokens over the concatenated documents."""
    stream = np.array([t for doc in _pyarrow_documents(cache) for t in doc], dtype=np.int32)
    n = len(stream) // SEQ
    return stream[: n * SEQ].reshape(n, SEQ)


def _global_batches(config, data, count: int) -> list:
    """Each step's global batch, as `count` processes read their slices of it, concatenated in process order."""
    view = example_view(config.data)
    t = config.trainer
    readers = [
        TrainBatches.from_caches(data, config.data, SEQ, t.train_batch_size, t.seed, ProcessSlice(i, count), view)
        for i in range(count)
    ]
    out = []
    for step in range(STEPS):
        parts = [r.batch(step) for r in readers]
        if isinstance(parts[0], dict):
            out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        else:
            out.append(np.concatenate(parts))
    return out


@pytest.mark.parametrize("shuffle", ["false", "6", "true"])
def test_a_single_source_gives_the_single_source_order_for_any_process_count(corpus, shuffle):
    config = _config(corpus, "--data.shuffle", shuffle)
    data = prepare_data(config.data, background=False, progress=False)
    assert list(data.sources) == [SINGLE_SOURCE] and data.sources[SINGLE_SOURCE].train == data.train_cache
    windows = _pyarrow_windows(data.train_cache)
    n = len(windows)
    assert n < BATCH * STEPS  # the steps run past the first epoch, which starts over
    base = shard_cache.open_cache(data.train_cache).token_windows(SEQ)
    order = {"false": None, "6": base.era_shuffled(SEED, 6), "true": base.shuffled(SEED)}[shuffle]
    expected = []
    for step in range(STEPS):
        positions = np.arange(step * BATCH, (step + 1) * BATCH) % n
        expected.append(windows[positions if order is None else order.example_indices(positions)])
    if shuffle != "false":
        assert not np.array_equal(expected[0], windows[:BATCH])  # the order is really shuffled
    for count in (1, 2, 4):
        got = _global_batches(config, data, count)
        for step in range(STEPS):
            np.testing.assert_array_equal(got[step], expected[step], err_msg=f"step {step}, {count} processes")


def test_packed_prompt_completion_examples_keep_the_single_source_order(corpus):
    records = corpus[4]
    config = _config(
        corpus, "--data.train_urls", json.dumps([records]), "--data.validation_urls", "[]", "--data.format",
        "prompt_completion", "--data.shuffle", "true",
    )  # fmt: skip
    data = prepare_data(config.data, background=False, progress=False)
    reference = shard_cache.PackedSequences(
        shard_cache.open_cache(data.train_cache), SEQ, long_documents=config.data.long_document_rule
    )
    documents = _pyarrow_documents(data.train_cache)
    assert reference.wait_for_final() > 0 and len(documents) == 40
    final = reference.final_num_examples()
    shuffled = reference.shuffled(SEED)
    got = _global_batches(config, data, 2)
    for step in range(STEPS):
        positions = np.arange(step * BATCH, (step + 1) * BATCH) % final
        expected = shuffled.get_batch(positions)
        assert sorted(got[step]) == sorted(example_fields(config.data))
        for field in expected:
            np.testing.assert_array_equal(got[step][field], expected[field], err_msg=f"{field}, step {step}")
    # Every packed row's tokens are pyarrow's documents, whole, in order: the reference reads the cache as it is.
    first = shuffled.get_batch(np.arange(final))
    tokens = {tuple(doc) for doc in documents}
    for ids, segments in zip(first["input_ids"], first["segment_ids"], strict=True):
        for segment in set(segments[segments > 0].tolist()):
            assert tuple(ids[segments == segment].tolist()) in tokens


def test_the_evaluation_reads_the_validation_cache_in_order_in_full_batches(corpus):
    config = _config(corpus, "--trainer.max_eval_batches", "null")
    data = prepare_data(config.data, background=False, progress=False)
    windows = _pyarrow_windows(data.validation_cache)
    full = len(windows) // BATCH * BATCH
    assert full >= 2 * BATCH
    plan = plan_mesh(config.trainer)
    for count in (1, 2):
        evaluators = [
            Evaluator(config, plan, data, ProcessSlice(i, count), parse_policy(config.trainer.mp)) for i in range(count)
        ]
        assert all(e.has_data and list(e.sources) == [SINGLE_SOURCE] for e in evaluators)
        per_process = [list(e.batches()) for e in evaluators]
        batches = [np.concatenate(parts) for parts in zip(*per_process, strict=True)]
        np.testing.assert_array_equal(np.concatenate(batches), windows[:full])


def test_a_batch_size_schedule_cuts_the_same_examples_into_its_sizes_and_pads_what_does_not_divide(corpus):
    """Sizes 4, 8, then 6 (padded to 8 over 4 devices and 2 processes): step s holds the examples of positions
    [sum of the sizes before s, + its size) of the era-shuffled single-source order, read back with pyarrow."""
    schedule = "[{start: 0, value: 4}, {start: 3, value: 8}, {start: 6, value: 6}]"
    config = _config(corpus, "--data.shuffle", "6", "--trainer.train_batch_size", schedule)
    data = prepare_data(config.data, background=False, progress=False)
    windows = _pyarrow_windows(data.train_cache)
    order = shard_cache.open_cache(data.train_cache).token_windows(SEQ).era_shuffled(SEED, 6)
    sizes = [4, 4, 4, 8, 8, 8, 6, 6, 6, 6, 6, 6]  # steps 0-11, written out by hand
    starts = np.cumsum([0, *sizes])
    assert starts[-1] > len(windows)  # the last steps start the data over
    view, t = example_view(config.data), config.trainer
    for count, pad_to in ((1, 1), (2, 1), (2, 4)):
        readers = [
            TrainBatches.from_caches(
                data, config.data, SEQ, t.batch_schedule, t.seed, ProcessSlice(i, count), view, pad_to
            )
            for i in range(count)
        ]
        for step, size in enumerate(sizes):
            positions = np.arange(starts[step], starts[step] + size) % len(windows)
            parts = [r.batch(step) for r in readers]
            if pad_to == 1:
                np.testing.assert_array_equal(np.concatenate(parts), windows[order.example_indices(positions)])
                continue
            ids = np.concatenate([p["input_ids"] for p in parts])
            mask = np.concatenate([p["loss_mask"] for p in parts])
            assert len(ids) == -(-size // 4) * 4, f"step {step}"
            np.testing.assert_array_equal(ids[:size], windows[order.example_indices(positions)])
            assert (ids[size:] == 0).all() and mask[:size].all() and not mask[size:].any()
