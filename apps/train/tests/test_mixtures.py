"""Mixture configs are checked in preflight with errors that name the key; a mixture's batches follow shard-cache's
sampler (per-block counts, stage changes, any number of processes, resume) and its accounting matches them."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import shard_cache
from lm_train.data.batches import ProcessSlice, TrainBatches, source_seed
from lm_train.data.prefetch import Prefetcher
from lm_train.errors import ConfigError
from lm_train.run.distributed import DistributedInfo
from lm_train.run.evaluation import weighted_loss
from lm_train.run.preflight import prepare_run

ONE = DistributedInfo(0, 1, "test")
SOURCES = "{a: {train_urls: [/nonexistent/a.jsonl]}, b: {train_urls: [/nonexistent/b.jsonl]}}"


def mixture(make_config, weights: str, *overrides: str):
    return make_config("--data.builtin", "null", "--data.configs", SOURCES, "--data.train_weights", weights, *overrides)


@pytest.mark.parametrize(
    ("weights", "overrides", "message"),
    [
        ("{a: -1, b: 1}", [], r"data\.train_weights\.a: the weight -1 is negative"),
        ("{a: 0, b: 0}", [], r"data\.train_weights: every weight is 0"),
        ("{a: 1, c: 1}", [], r"data\.train_weights\.c: there is no source named 'c'; the sources are a, b"),
        ("[[0, {a: 1}], [4, {b: 1}], [4, {a: 1}]]", [], r"data\.train_weights\[2\]: this stage starts at step 4, not"),
        ("[[0, {a: 1}], [4, {b: 1}], [2, {a: 1}]]", [], r"data\.train_weights\[2\]: this stage starts at step 2"),
        ("[[3, {a: 1}]]", [], r"data\.train_weights\[0\]: the first stage starts at step 3"),
        ("[[0, {a: 1}], [4, {a: 0, b: 0}]]", [], r"data\.train_weights\[1\]: every weight is 0"),
        ("[[0, {a: 1}], [4, {b: x}]]", [], r"data\.train_weights\[1\]\.b: the weight must be a finite number"),
        ("{a: 1}", ["--data.mixture_block_size", "0"], r"data\.mixture_block_size: must be a whole number"),
        ("{a: 1}", ["--data.stop_strategy", "never"], r"data\.stop_strategy: 'never' is not a stop strategy"),
    ],
)
def test_bad_mixture_settings_fail_in_preflight_naming_the_key(make_config, tmp_path, weights, overrides, message):
    run_dir = tmp_path / "run"
    config = mixture(make_config, weights, "--trainer.run_dir", str(run_dir), *overrides)
    # The sources' files do not exist: the weights are checked before any data is looked at.
    with pytest.raises(ConfigError, match=message):
        prepare_run(config, ONE)
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--data.configs", "{'a b': {train_urls: [x]}}"], r"data\.configs\.a b: a source name is used in metric"),
        (["--data.configs", "{a: {train_urls: [x], builtin: python_stdlib}}"], r"data\.configs\.a: give this source"),
        (["--data.configs", "{a: {}}"], r"data\.configs\.a: give this source exactly one .* \(got none\)"),
        (["--data.configs", "{a: {train_urls: [x], packages: [json]}}"], r"data\.configs\.a: `packages`"),
    ],
)
def test_bad_sources_fail_in_preflight_naming_the_key(make_config, overrides, message):
    config = make_config("--data.builtin", "null", *overrides)
    with pytest.raises(ConfigError, match=message):
        prepare_run(config, ONE)


def test_mixture_keys_are_checked_when_the_config_loads(make_config):
    with pytest.raises(ConfigError, match=r"data\.configs\.a\.trian_urls"):
        make_config("--data.builtin", "null", "--data.configs", "{a: {trian_urls: [x]}}")
    with pytest.raises(ConfigError, match=r"data\.validation_urls: a mixture's validation documents"):
        mixture(make_config, "{a: 1}", "--data.validation_urls", "[v.jsonl]")
    with pytest.raises(ConfigError, match="exactly one source of training text"):
        mixture(make_config, "{a: 1}", "--data.train_urls", "[t.jsonl]")
    with pytest.raises(ConfigError, match=r"data\.train_weights: weights are for a mixture's sources"):
        make_config("--data.train_weights", "{a: 1}")


class MemoryReader:
    """A finished cache held in memory, for TokenWindows: example i of source s is s * 10_000 + i, repeated."""

    def __init__(self, source: int, num_examples: int, seq_len: int):
        ids = np.arange(num_examples, dtype=np.int32) + source * 10_000
        self.stream = np.repeat(ids, seq_len)
        self.num_tokens, self.finished, self.url = len(self.stream), True, f"memory://{source}"

    def wait_until(self, condition, timeout, what):
        if not condition():
            raise IndexError(f"{self.url}: {what}, but the finished cache does not have it.")

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.stream[start:stop]

    def committed_state(self) -> tuple[int, bool]:
        return self.num_tokens, self.finished


SEQ, BATCH, BLOCK, SEED = 4, 8, 12, 3
WEIGHTS = "[[0, {a: 2, b: 1}], [7, {a: 1, b: 3}]]"
EXAMPLES = {"a": 500, "b": 400}


def batches(make_config, part=ProcessSlice(), *overrides: str, seed: int = SEED) -> TrainBatches:
    config = mixture(make_config, WEIGHTS, "--data.mixture_block_size", str(BLOCK), *overrides)
    windows = {name: shard_cache.TokenWindows(MemoryReader(s, EXAMPLES[name], SEQ), SEQ) for s, name in enumerate("ab")}
    return TrainBatches(windows, config.data, BATCH, seed, part)


def drawn(rows: np.ndarray) -> list[tuple[int, int]]:
    """(source, example) of each row."""
    assert (rows == rows[:, :1]).all()
    return [divmod(int(v), 10_000) for v in rows[:, 0]]


def test_batches_follow_the_package_sampler_block_by_block(make_config):
    # a: era-shuffled (the config's data.shuffle); b: in order (its own shuffle: false)
    mix = batches(make_config, ProcessSlice(), "--data.shuffle", "16", "--data.configs.b.shuffle", "false")
    steps = 16
    rows = [d for step in range(steps) for d in drawn(mix.batch(step))]
    schedule = shard_cache.parse_train_weights([[0, {"a": 2, "b": 1}], [7, {"a": 1, "b": 3}]], ["a", "b"])
    layout = shard_cache.MixtureLayout(schedule, batch_size=BATCH, block_size=BLOCK, seed=SEED)
    sources, indices = layout.locate(np.arange(steps * BATCH))
    assert [s for s, _ in rows] == sources.tolist()  # the package's choice of source at every position
    assert [i for s, i in rows if s == 1] == indices[sources == 1].tolist()  # b is read in order
    a_draws = [i for s, i in rows if s == 0]
    # a: era-shuffled, exactly as the package's era shuffle orders it under the source's own seed
    era_order = shard_cache.TokenWindows(MemoryReader(0, EXAMPLES["a"], SEQ), SEQ).era_shuffled(
        source_seed(SEED, "a"), 16
    )
    reference = [int(era_order.get_batch(np.array([k]))[0, 0]) for k in range(len(a_draws))]
    assert a_draws == reference and a_draws != sorted(a_draws)
    # Every full block draws exactly the weights' largest-remainder counts; the stage changes at step 7 exactly.
    for stage, (first, last) in enumerate([(0, 7 * BATCH), (7 * BATCH, steps * BATCH)]):
        counts = schedule.block_counts(stage, BLOCK)
        for start in range(first, last - BLOCK + 1, BLOCK):
            assert Counter(s for s, _ in rows[start : start + BLOCK]) == {0: counts[0], 1: counts[1]}
    assert counts == (3, 9) and schedule.block_counts(0, BLOCK) == (8, 4)
    # tokens_seen and the weight in force, against the rows actually drawn
    metrics = mix.data_metrics(steps)
    assert metrics["data/a/tokens_seen"] == len(a_draws) * SEQ
    assert metrics["data/b/tokens_seen"] == (steps * BATCH - len(a_draws)) * SEQ
    assert (metrics["data/a/weight"], mix.data_metrics(7)["data/a/weight"]) == (0.25, pytest.approx(2 / 3))


@pytest.mark.parametrize("count", [2, 4])
def test_process_slices_and_a_resumed_reader_give_the_same_global_batches(make_config, count):
    whole = batches(make_config)
    parts = [batches(make_config, ProcessSlice(i, count)) for i in range(count)]
    for step in (0, 5, 6, 7, 11):  # across a block boundary and the stage change; a fresh reader starts mid-run
        expected = whole.batch(step)
        assert np.array_equal(np.concatenate([p.batch(step) for p in parts]), expected)
        assert np.array_equal(batches(make_config).batch(step), expected)


def test_first_exhausted_ends_the_prefetched_steps_before_the_short_one(make_config):
    mix = batches(make_config, ProcessSlice(), "--data.stop_strategy", "first_exhausted")
    end = mix.examples.exhaustion_step()
    assert end is not None and 0 < end < 200
    prefetch = Prefetcher(mix.batch, 0, 200, end_of_data=(shard_cache.MixtureExhaustedError,))
    try:
        assert [step for step, _ in prefetch] == list(range(end))
    finally:
        prefetch.close()
    assert isinstance(prefetch.ended_by, shard_cache.MixtureExhaustedError) and prefetch.ended_by.step == end
    restarting = batches(make_config)  # the default, restart: an exhausted source starts over
    assert drawn(restarting.batch(end + 60)) and restarting.batch(end + 60).shape == (BATCH, SEQ)


def test_eval_loss_is_the_weighted_mean_of_the_sources_losses():
    assert weighted_loss({"a": 2.0, "b": 4.0}, {"a": 0.75, "b": 0.25}) == pytest.approx(2.5)
    assert weighted_loss({"a": 2.0}, {"a": 0.5, "b": 0.5}) == pytest.approx(2.0)  # over the sources evaluated
    assert weighted_loss({"a": 2.0, "c": 6.0}, {"a": 0.0, "b": 1.0}) == pytest.approx(4.0)  # none trained: equal


def test_the_example_config_splits_the_builtin_corpus_into_two_domains():
    from pathlib import Path

    from lm_train.config import load_train_config
    from lm_train.config.mixture_keys import mixture_schedule
    from lm_train.data.corpus import split_stdlib, stdlib_root
    from lm_train.data.inputs import source_inputs

    config, _ = load_train_config([Path(__file__).parents[3] / "configs" / "gpt2_nano_mixture.yaml"])
    schedule = mixture_schedule(config.data)
    assert schedule.names == ("email_asyncio", "rest") and schedule.starts == (0, 100)
    inputs = {name: source_inputs(config.data, name) for name in schedule.names}
    split = split_stdlib(config.data.validation_fraction)
    for part in ("train", "validation"):
        ours, theirs = inputs["email_asyncio"], inputs["rest"]
        assert sorted(getattr(ours, part) + getattr(theirs, part)) == sorted(map(str, getattr(split, part)))
        packages = {Path(f).relative_to(stdlib_root()).parts[0] for f in getattr(ours, part)}
        assert packages == {"email", "asyncio"}  # each domain has validation files of its own
        assert not any(Path(f).relative_to(stdlib_root()).parts[0] in packages for f in getattr(theirs, part))


def test_a_fully_shuffled_source_draws_a_permutation_of_its_examples(make_config):
    mix = batches(make_config, ProcessSlice(), "--data.shuffle", "true")
    rows = [d for step in range(80) for d in drawn(mix.batch(step))]
    b_draws = [i for s, i in rows if s == 1]
    assert len(b_draws) > EXAMPLES["b"]  # past one epoch: the source starts over (stop_strategy restart)
    first_epoch = b_draws[: EXAMPLES["b"]]
    assert sorted(first_epoch) == list(range(EXAMPLES["b"])) and first_epoch != sorted(first_epoch)
    other = batches(make_config, ProcessSlice(), "--data.shuffle", "true", seed=SEED + 1)
    assert [i for step in range(8) for s, i in drawn(other.batch(step)) if s == 1][:8] != b_draws[:8]
