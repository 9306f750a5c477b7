"""Mixtures over real caches (built with the real builder, checked against plain pyarrow reads) and over
in-memory sources that grow on demand (for the waiting rules)."""

import json
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from shard_cache import (
    MixtureExamples,
    MixtureExhaustedError,
    MixtureLayout,
    ShardCacheError,
    TokenizerProcessor,
    build_cache,
    example_source,
    mixture_examples,
    open_cache,
    parse_train_weights,
    start_build,
)

SEQ = 16
DOCS = {"big": 40, "mid": 24, "small": 6}
# batch 12, blocks of 32: the stage change at step 7 (position 84) falls inside block 2
STAGES = [[0, {"big": 0.5, "mid": 0.25, "small": 0.25}], [7, {"big": 0.2, "mid": 0.6, "small": 0.2}]]
BATCH = 12
BLOCK = 32


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tokenizer_path, tools):
    """Three caches built with the real builder, and each one's windows read back with plain pyarrow."""
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for seed, (name, count) in enumerate(DOCS.items()):
        corpus = tools.write_jsonl(root / f"{name}.jsonl", tools.make_docs(count, seed=40 + seed))
        cache = root / f"cache-{name}"
        build_cache([str(corpus)], str(cache), tokenizer=str(tokenizer_path), chunk_size=4, progress=False)
        order = json.loads((cache / "ledger.json").read_text())["order"]
        pieces = [
            pq.read_table(cache / "chunks" / f"{s:05d}" / f"{c:06d}.parquet").column("input_ids").to_pylist()
            for s, c in order
        ]
        stream = np.array([t for chunk in pieces for doc in chunk for t in doc], dtype=np.int32)
        n = len(stream) // SEQ
        out[name] = (str(cache), stream[: n * SEQ].reshape(n, SEQ))
    return out


def open_views(caches):
    """Fresh readers, as a new process (or a resumed run) has: one plain, one era-shuffled, one shuffled view."""
    big = open_cache(caches["big"][0]).token_windows(SEQ)
    mid = open_cache(caches["mid"][0]).token_windows(SEQ).era_shuffled(seed=3, era_length=5)
    small = open_cache(caches["small"][0]).token_windows(SEQ).shuffled(seed=4)
    return {"big": big, "mid": mid, "small": small}


def mixture(caches, stop_strategy="restart", seed=9):
    return mixture_examples(
        open_views(caches), STAGES, batch_size=BATCH, block_size=BLOCK, seed=seed, stop_strategy=stop_strategy
    )


def test_batches_hold_each_sources_examples_and_restart_exhausted_ones(caches):
    mix = mixture(caches)
    views = open_views(caches)
    sizes = {name: len(windows) for name, (_, windows) in caches.items()}
    steps = next(s for s in range(1000) if mix.examples_seen(s)["small"] > 3 * sizes["small"])  # 3 restarts
    for step in range(steps):
        batch = mix.batch(step)
        sources, indices = mix.layout.locate(mix.layout.step_positions(step))
        for row, s, index in zip(batch, sources, indices, strict=True):
            name = mix.names[s]
            wrapped = int(index) % sizes[name]
            if name == "big":  # the plain view: the cache's own windows, as pyarrow reads them
                np.testing.assert_array_equal(row, caches["big"][1][wrapped])
            else:  # a shuffled view: its example at the wrapped index
                np.testing.assert_array_equal(row, views[name].get_batch([wrapped])[0])
    assert mix.tokens_seen(steps) == {n: c * SEQ for n, c in mix.examples_seen(steps).items()}
    assert sum(mix.examples_seen(steps).values()) == steps * BATCH
    assert mix.weights_at(6) == {"big": 0.5, "mid": 0.25, "small": 0.25}
    assert mix.weights_at(7) == pytest.approx({"big": 0.2, "mid": 0.6, "small": 0.2})


def test_global_batches_are_the_same_for_one_two_and_four_readers(caches):
    steps = range(12)  # across blocks and the stage change at step 7
    one = [mixture(caches).batch(step) for step in steps]
    for count in (2, 4):
        readers = [mixture(caches) for _ in range(count)]  # each with its own fresh readers
        for step, expected in zip(steps, one, strict=True):
            slices = [r.batch(step, process_index=p, process_count=count) for p, r in enumerate(readers)]
            np.testing.assert_array_equal(np.concatenate(slices), expected)
            ids = [r.source_ids(step, process_index=p, process_count=count) for p, r in enumerate(readers)]
            np.testing.assert_array_equal(np.concatenate(ids), readers[0].source_ids(step))


def test_a_resume_mid_block_and_mid_stage_continues_the_sequence(caches):
    whole = mixture(caches)
    expected = [whole.batch(step) for step in range(14)]
    # step 5 starts at position 60, in the middle of block 1 of stage 0; step 9 at 108, mid-block in stage 1
    for resume_at in (5, 9):
        resumed = mixture(caches)
        for step in range(resume_at, 14):
            np.testing.assert_array_equal(resumed.batch(step), expected[step])
    # another seed is another sequence
    assert not np.array_equal(mixture(caches, seed=10).batch(3), expected[3])


def test_first_exhausted_ends_every_reader_at_the_same_defined_step(caches):
    mix = mixture(caches, "first_exhausted")
    sizes = {name: len(windows) for name, (_, windows) in caches.items()}
    # expected: the first step whose batch would draw a source past its last example, from the layout's counts
    end = next(s for s in range(10_000) if any(mix.examples_seen(s + 1)[n] > sizes[n] for n in sizes))
    short = next(n for n in sizes if mix.examples_seen(end + 1)[n] > sizes[n])
    assert mix.exhaustion_step() == end
    assert mix.batch(end - 1).shape == (BATCH, SEQ)
    readers = [mixture(caches, "first_exhausted") for _ in range(4)]
    slices = [mix.source_ids(end, process_index=p, process_count=4) for p in range(4)]
    assert any(mix.names.index(short) not in ids for ids in slices)  # a reader that does not draw from it
    for p, reader in enumerate(readers):  # every reader, also those whose slice draws nothing from that source
        with pytest.raises(MixtureExhaustedError) as error:
            reader.batch(end, process_index=p, process_count=4)
        assert (error.value.step, error.value.source, error.value.num_examples) == (end, short, sizes[short])
        message = str(error.value)
        assert f"exhausted at step {end}: source {short!r} has {sizes[short]} examples" in message
        assert "stop_strategy 'restart'" in message
    with pytest.raises(MixtureExhaustedError):
        mix.get_batch(mix.layout.step_positions(end + 3))
    # restart serves the same steps before the end, and carries on after it
    restart = mixture(caches)
    np.testing.assert_array_equal(restart.batch(end - 1), mix.batch(end - 1))
    assert restart.batch(end + 3).shape == (BATCH, SEQ) and restart.exhaustion_step() is None


def test_a_source_still_being_built_is_waited_for_and_restarted_once_final(caches, tmp_path, tokenizer_path, tools):
    class SlowTokenizerProcessor(TokenizerProcessor):  # defined here, so Ray ships the class by value
        def __call__(self, docs):
            time.sleep(0.1)
            return super().__call__(docs)

    corpus = tools.write_jsonl(tmp_path / "growing.jsonl", tools.make_docs(12, seed=77))
    growing = str(tmp_path / "growing")
    handle = start_build(
        [str(corpus)], growing, processor=SlowTokenizerProcessor(str(tokenizer_path)), chunk_size=2, progress=False
    )
    weights = {"big": 1, "growing": 1}

    def growing_mixture():
        views = {"big": open_cache(caches["big"][0]).token_windows(SEQ)}
        views["growing"] = open_cache(growing, timeout=60, poll_interval=0.05).token_windows(SEQ)
        return mixture_examples(views, weights, batch_size=BATCH, block_size=BLOCK, seed=2, timeout=60)

    early = growing_mixture()
    first = early.batch(0)  # as soon as the first chunks are committed
    assert not handle.done() and early.layout.examples_seen(1)["growing"] > 0
    late_step = next(s for s in range(1000) if early.examples_seen(s)["growing"] > 60)  # past its end: wraps
    late = early.batch(late_step)  # waits for the build to finish, then restarts the source
    # The ledger says final before the build's thread returns, so the reader cannot have run ahead of the build.
    assert open_cache(growing).finished
    handle.wait(timeout=60)
    after = growing_mixture()  # a reader that opens the finished cache sees the same sequence
    np.testing.assert_array_equal(first, after.batch(0))
    np.testing.assert_array_equal(late, after.batch(late_step))


class MemorySource:
    """An in-memory example source that grows when told to, with the protocol's waiting rules and timeout.

    Row i of source number k holds k * 1000 + i in every column, so a batch says where each row came from.
    """

    def __init__(self, number: int, size: int, committed: int | None = None, finished: bool = True):
        self.seq_len = 4
        self.rows = np.repeat(np.arange(number * 1000, number * 1000 + size, dtype=np.int32)[:, None], 4, axis=1)
        self.committed = size if committed is None else committed
        self.finished = finished
        self.asked: list[np.ndarray] = []
        self._cond = threading.Condition()

    def grow(self, committed: int, finished: bool = False) -> None:
        with self._cond:
            self.committed, self.finished = committed, finished
            self._cond.notify_all()

    def wait_for_examples(self, count: int, timeout: float | None = None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.committed >= count or self.finished, timeout):
                raise TimeoutError(f"waited {timeout} s for {count} examples")
            if self.committed < count:
                raise IndexError(f"{count} examples, but the finished source has {self.committed}")

    def get_batch(self, indices, timeout=None):
        indices = np.asarray(indices, dtype=np.int64)
        self.asked.append(indices)
        if len(indices):
            self.wait_for_examples(int(indices.max()) + 1, timeout)
        return self.rows[indices]

    def final_num_examples(self):
        return self.committed if self.finished else None


def memory_mixture(sources, stop_strategy="restart", weights=None):
    weights = weights or {name: 1 for name in sources}
    return mixture_examples(sources, weights, batch_size=8, block_size=16, seed=1, stop_strategy=stop_strategy)


def later(delay, fn, *args):
    thread = threading.Thread(target=lambda: (time.sleep(delay), fn(*args)), daemon=True)
    thread.start()
    return thread


def test_a_lookup_waits_for_its_own_source_and_not_for_the_others():
    ready, growing = MemorySource(0, 1000), MemorySource(1, 1000, committed=0, finished=False)
    mix = memory_mixture({"ready": ready, "growing": growing})
    assert mix.names == ("growing", "ready")  # sources are numbered in sorted order
    ids = mix.source_ids(0)
    only_ready = np.flatnonzero(ids == 1)[:3]  # positions of step 0 that the ready source fills
    rows = mix.get_batch(only_ready, timeout=0.0)  # returns at once: the growing source is not asked
    assert set(rows[:, 0] // 1000) == {0} and growing.asked == []
    with pytest.raises(TimeoutError, match=r"waited 0\.2 s"):  # the source's own timeout, passed through
        mix.batch(0, timeout=0.2)
    later(0.3, growing.grow, 20)
    started = time.monotonic()
    batch = mix.batch(0, timeout=30)  # waits until the growing source commits its examples
    assert time.monotonic() - started >= 0.25
    expected = np.where(ids == 1, 0, 1000) + mix.layout.locate(mix.layout.step_positions(0))[1]
    np.testing.assert_array_equal(batch[:, 0], expected)


def test_a_source_that_finishes_short_while_waited_on_restarts_or_ends_the_mixture():
    for strategy in ("restart", "first_exhausted"):
        ready, growing = MemorySource(0, 1000), MemorySource(1, 5, committed=3, finished=False)
        mix = memory_mixture({"ready": ready, "growing": growing}, strategy)
        step = 2  # the growing source's draws in steps 0-2 go past its final 5 examples
        assert mix.examples_seen(step + 1)["growing"] > 5
        later(0.2, growing.grow, 5, True)
        if strategy == "restart":
            batch = mix.batch(step, timeout=30)
            sources, indices = mix.layout.locate(mix.layout.step_positions(step))
            np.testing.assert_array_equal(batch[:, 0], np.where(sources == 1, indices, 1000 + indices % 5))
        else:
            end = next(s for s in range(10) if mix.examples_seen(s + 1)["growing"] > 5)
            with pytest.raises(MixtureExhaustedError) as error:
                mix.batch(step, timeout=30)
            assert (error.value.step, error.value.source) == (end, "growing") and end <= step
            assert mix.exhaustion_step() == end


def test_an_evaluation_only_source_is_never_read():
    train, held_out = MemorySource(0, 100), MemorySource(1, 100, committed=0, finished=False)
    mix = memory_mixture({"train": train, "held_out": held_out}, "first_exhausted", {"train": 1, "held_out": 0})
    for step in range(5):
        assert set(mix.batch(step, timeout=0)[:, 0] // 1000) == {0}
    assert held_out.asked == [] and mix.layout.schedule.evaluation_only() == ("held_out",)
    assert mix.tokens_seen(5) == {"held_out": 0, "train": 5 * 8 * 4}


class FieldSource(MemorySource):
    """A MemorySource whose examples are fields, as packed documents are: ids, and a mask of the even ids."""

    def get_batch(self, indices, timeout=None):
        rows = super().get_batch(indices, timeout)
        return {"input_ids": rows, "loss_mask": rows % 2 == 0}


def test_sources_of_fields_give_a_batch_of_fields_in_the_layouts_order():
    mix = memory_mixture({"a": FieldSource(0, 7), "b": FieldSource(1, 1000)}, weights={"a": 1, "b": 3})
    for step in range(4):  # source a (7 examples) restarts within these steps
        batch = mix.batch(step, process_index=1, process_count=2)
        sources, indices = mix.layout.locate(mix.layout.step_positions(step)[4:])
        ids = np.where(sources == 0, indices % 7, 1000 + indices)
        assert sorted(batch) == ["input_ids", "loss_mask"]
        assert batch["input_ids"].dtype == np.int32 and batch["loss_mask"].dtype == bool
        np.testing.assert_array_equal(batch["input_ids"], np.repeat(ids[:, None], 4, axis=1))
        np.testing.assert_array_equal(batch["loss_mask"], np.repeat(ids[:, None] % 2 == 0, 4, axis=1))


def test_misconfigured_mixtures_get_clear_errors():
    schedule = parse_train_weights({"a": 1, "b": 1}, ["a", "b"])
    layout = MixtureLayout(schedule, batch_size=4, block_size=8)
    with pytest.raises(ShardCacheError, match=r"trains on \['b'\], but no example source was given"):
        MixtureExamples({"a": MemorySource(0, 10)}, layout)
    with pytest.raises(ShardCacheError, match=r"sources \['c'\] have no weight in the schedule"):
        MixtureExamples({"a": MemorySource(0, 10), "b": MemorySource(1, 10), "c": MemorySource(2, 10)}, layout)
    odd = MemorySource(1, 10)
    odd.seq_len = 8
    with pytest.raises(ShardCacheError, match="different example lengths"):
        MixtureExamples({"a": MemorySource(0, 10), "b": odd}, layout)
    with pytest.raises(ShardCacheError, match="stop_strategy: 'stop' is not a stop strategy"):
        MixtureExamples({"a": MemorySource(0, 10), "b": MemorySource(1, 10)}, layout, stop_strategy="stop")
    empty = MixtureExamples({"a": MemorySource(0, 10), "b": MemorySource(1, 0)}, layout)
    with pytest.raises(ShardCacheError, match=r"source 'b' is finished and holds no example of 4 tokens"):
        empty.batch(0)
    with pytest.raises(TypeError, match="list is not an example source"):
        example_source([1, 2, 3])
