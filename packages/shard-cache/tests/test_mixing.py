"""The training order mixes a corpus whose file order clusters similar documents (folders of one topic)."""

import json
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from shard_cache import TokenizerProcessor, open_cache, start_build

TOPICS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
FILES_PER_TOPIC = 8
SEQ_LEN = 16
ERA = 24


def gated_processor(tokenizer_path, gate, out, file_of_text):
    """The tokenizer processor, holding the chunks of shards 4 and on until the file `gate`/open exists.

    The first four chunks of the global order are chunk 0 of shards 0-3 (one chunk per shard here), so those
    commit whichever worker takes them, while every later chunk waits.
    """

    class GatedTokenizerProcessor(TokenizerProcessor):
        def __call__(self, docs):
            shards = json.loads((out / "cache.json").read_text())["shards"]
            file = file_of_text[docs[0].strip()]
            shard = next(i for i, s in enumerate(shards) if file in s["files"])
            while shard >= 4 and not (gate / "open").exists():
                time.sleep(0.02)
            return super().__call__(docs)

    return GatedTokenizerProcessor(str(tokenizer_path))


def stream_topics(cache) -> np.ndarray:
    """The topic of every token of the unshuffled stream, from plain JSON and pyarrow reads of the cache."""
    settings = json.loads((cache / "cache.json").read_text())
    ledger = json.loads((cache / "ledger.json").read_text())
    topics = []
    for shard, chunk in ledger["order"]:
        table = pq.read_table(cache / "chunks" / f"{shard:05d}" / f"{chunk:06d}.parquet")
        files = settings["shards"][shard]["files"][chunk * settings["chunk_size"] :]  # one document per file
        for ids, path in zip(table.column("input_ids").to_pylist(), files, strict=False):
            topics.extend([TOPICS.index(path.split("/")[-2])] * len(ids))
    return np.array(topics)


def topics_per_era(example_topics: np.ndarray) -> list[int]:
    return [len(set(example_topics[i : i + ERA].tolist())) for i in range(0, len(example_topics), ERA)]


def read_while_held(out, handle):
    """A reader that starts while the build is held after four chunks: it reads the era-shuffled order as
    training does, and lays out only the eras that the four chunks fill."""
    reader = open_cache(str(out), timeout=60, poll_interval=0.05)
    reader.wait_until(lambda: reader.num_chunks == 4, 60, "four chunks")
    early = reader.token_windows(SEQ_LEN).era_shuffled(seed=5, era_length=ERA)
    early.example_indices([0], timeout=60)  # waits for the first era
    laid_out = early.shuffle.covered
    first = early.example_indices(np.arange(laid_out))  # all that four chunks determine
    assert not handle.done() and reader.num_chunks == 4 and 0 < laid_out < reader.num_tokens // SEQ_LEN
    with pytest.raises(TimeoutError):  # the next position waits for more of the stream
        early.example_indices([laid_out], timeout=0.3)
    return early, laid_out, first


def test_era_shuffle_of_clustered_files_mixes_every_era_the_same_whenever_it_is_read(tmp_path, tokenizer_path, tools):
    docs = tools.make_docs(len(TOPICS) * FILES_PER_TOPIC, seed=31)
    file_of_text = {}
    for t, topic in enumerate(TOPICS):
        (tmp_path / "corpus" / topic).mkdir(parents=True)
        for i in range(FILES_PER_TOPIC):
            text = f"{topic} {topic}. " + docs[t * FILES_PER_TOPIC + i]
            path = tmp_path / "corpus" / topic / f"{i:02d}.txt"
            path.write_text(text)
            file_of_text[text.strip()] = str(path)
    out, gate = tmp_path / "cache", tmp_path / "gate"
    gate.mkdir()
    handle = start_build(
        [str(tmp_path / "corpus" / "*" / "*.txt")],
        str(out),
        processor=gated_processor(tokenizer_path, gate, out, file_of_text),
        fmt="text",
        files_per_shard=4,
        chunk_size=4,
        num_workers=2,
        progress=False,
    )
    try:
        early, laid_out, first = read_while_held(out, handle)
    finally:
        (gate / "open").touch()  # even when that failed: a held build would keep the session's Ray CPUs
    handle.wait(timeout=120)
    windows = open_cache(str(out)).token_windows(SEQ_LEN)
    total = windows.final_num_examples()
    rest = [early.example_indices(np.arange(b, min(b + 8, total)), timeout=60) for b in range(laid_out, total, 8)]
    early_order = np.concatenate([first, *rest])
    late = windows.era_shuffled(seed=5, era_length=ERA)
    np.testing.assert_array_equal(early_order, late.example_indices(np.arange(total)))
    np.testing.assert_array_equal(np.sort(early_order), np.arange(total))
    np.testing.assert_array_equal(late.get_batch([0, 7]), windows.get_batch(early_order[[0, 7]]))

    # Files are dealt round-robin into shards, so each shard (and so each chunk) spans the topics.
    shards = json.loads((out / "cache.json").read_text())["shards"]
    assert len(shards) == 12 and all(len({f.split("/")[-2] for f in s["files"]}) == 4 for s in shards)

    topics = stream_topics(out)
    example_topic = topics[np.arange(total) * SEQ_LEN]
    mixed = topics_per_era(example_topic[early_order])
    # File order, which consecutive grouping and contiguous eras served before: each era is one or two topics.
    file_order = np.sort(topics)[np.arange(total) * SEQ_LEN]
    assert max(topics_per_era(file_order)) <= 2
    # Every full era draws from most topics: from the start, each committed chunk spans four of them.
    assert min(mixed[:-1]) >= 4 and np.mean(mixed[:-1]) >= 5, mixed
