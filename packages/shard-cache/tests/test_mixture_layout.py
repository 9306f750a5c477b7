"""The mixture's layout against a plain step-by-step replay, and the block and stage properties it promises."""

import hashlib
import time

import numpy as np
import pytest

from shard_cache import FeistelPermutation, MixtureLayout, parse_train_weights

NAMES = ["a", "b", "c", "eval"]
# stage boundaries at steps 5 and 9: with 6 examples a step, positions 30 and 54, inside blocks of 16
STAGES = [[0, {"a": 0.5, "b": 0.3, "c": 0.2}], [5, {"a": 1, "c": 3}], [9, {"b": 2, "c": 1, "a": 1}]]


def replay(schedule, batch_size, block_size, seed, count):
    """The first `count` (source, index) of a mixture, walked position by position with running counters.

    Written from the documented rules only: blocks restart at each stage's first position; block j of stage k
    holds each source's largest-remainder count, in the order of FeistelPermutation(block_size, key) with key
    from blake2b("shard-cache-mixture:{seed}:{k}:{j}"); a source's draws take its indices 0, 1, 2, ... in turn.
    """
    seen = dict.fromkeys(range(len(schedule.names)), 0)
    stage_starts = [s * batch_size for s in schedule.starts]
    out = []
    position = 0
    while position < count:
        k = max(i for i, start in enumerate(stage_starts) if start <= position)
        j = (position - stage_starts[k]) // block_size
        digest = hashlib.blake2b(f"shard-cache-mixture:{seed}:{k}:{j}".encode(), digest_size=8).digest()
        slots = []
        for s, weight in enumerate(schedule.exact[k]):
            slots += [s] * expected_count(schedule.exact[k], s, block_size)
            assert weight >= 0
        order = FeistelPermutation(block_size, int.from_bytes(digest, "little"))(np.arange(block_size))
        block_end = stage_starts[k] + (j + 1) * block_size
        if k + 1 < len(stage_starts):
            block_end = min(block_end, stage_starts[k + 1])
        for slot in order[: block_end - (stage_starts[k] + j * block_size)]:
            source = slots[slot]
            out.append((source, seen[source]))
            seen[source] += 1
        position = block_end
    return out[:count]


def expected_count(weights, s, block_size):
    """Largest remainder by hand: floor of each quota, then one more to the largest remainders (earlier first)."""
    quotas = [w * block_size for w in weights]
    floors = [int(q) for q in quotas]
    extra = sorted(range(len(weights)), key=lambda i: (floors[i] - quotas[i], i))[: block_size - sum(floors)]
    return floors[s] + (s in extra)


@pytest.fixture(scope="module")
def schedule():
    return parse_train_weights(STAGES, NAMES)


def test_layout_equals_the_replay_with_stages_cut_inside_blocks(schedule):
    layout = MixtureLayout(schedule, batch_size=6, block_size=16, seed=11)
    count = 200
    expected = replay(schedule, 6, 16, 11, count)
    sources, indices = layout.locate(np.arange(count))
    assert list(zip(sources.tolist(), indices.tolist(), strict=True)) == expected
    # accounting: examples seen by every step, and where each draw happens
    for step in range(count // 6):
        counts = np.bincount([s for s, _ in expected[: step * 6]], minlength=4)
        assert layout.examples_seen(step) == dict(zip(schedule.names, counts.tolist(), strict=True))
    for position, (s, index) in enumerate(expected):
        assert layout.position_of_draw(s, index) == position
    assert layout.position_of_draw(3, 0) is None  # the evaluation-only source is never drawn


def test_every_full_block_draws_the_fixed_counts(schedule):
    block = 20
    layout = MixtureLayout(schedule, batch_size=40, block_size=block, seed=0)  # stages start at 200 and 360
    sources, _ = layout.locate(np.arange(360 + 50 * block))
    blocks = [(0, 200, (10, 6, 4, 0)), (200, 360, (5, 0, 15, 0)), (360, len(sources), (5, 10, 5, 0))]
    for start, end, counts in blocks:
        for b in range(start, end, block):
            assert tuple(np.bincount(sources[b : b + block], minlength=4)) == counts, (b, counts)
    # counts are fixed, the order within each block is not: blocks differ from one another
    assert len({tuple(sources[b : b + block]) for b in range(360, len(sources), block)}) > 40


def test_a_stage_change_takes_effect_at_its_exact_step():
    stages = [[0, {"b": 1}], [5, {"a": 1}], [9, {"a": 1, "c": 1}]]
    schedule = parse_train_weights(stages, NAMES)
    layout = MixtureLayout(schedule, batch_size=7, block_size=2048, seed=3)  # every boundary inside one block
    sources = [set(layout.locate(layout.step_positions(step))[0].tolist()) for step in range(16)]
    assert sources[:9] == [{1}] * 5 + [{0}] * 4
    assert set().union(*sources[9:]) == {0, 2}
    assert [schedule.weights_at(step)["a"] for step in (4, 5, 8, 9)] == [0, 1, 1, 0.5]
    # a drawn in steps 5-8 only, then again from step 9: its indices carry on where they stopped
    assert layout.locate(layout.step_positions(5))[1].tolist() == list(range(7))
    assert layout.examples_seen(9) == {"a": 28, "b": 35, "c": 0, "eval": 0}


def test_lookups_are_random_access_and_agree_with_the_counts(schedule):
    layout = MixtureLayout(schedule, batch_size=64, block_size=2048, seed=5)
    rng = np.random.default_rng(0)
    far = np.concatenate([rng.integers(0, 10**12, 50), [10**15]])
    started = time.perf_counter()
    sources, indices = layout.locate(far)
    for position, s, index in zip(far, sources, indices, strict=True):
        # the index of a draw is the number of that source's draws before it
        assert layout.draws_before(int(position))[s] == index
        assert layout.position_of_draw(int(s), int(index)) == position
    assert time.perf_counter() - started < 5, "far lookups must not replay from position 0"
    # far into the last stage, the counts are the stage's proportions
    seen = layout.draws_before(10**15)
    assert np.allclose(seen / seen.sum(), [0.25, 0.5, 0.25, 0], atol=1e-9)


def test_ranges_locate_as_their_positions_do(schedule):
    layout = MixtureLayout(schedule, batch_size=6, block_size=16, seed=11)
    for start, stop in [(0, 6), (10, 20), (28, 32), (30, 36), (50, 58), (0, 120), (47, 48)]:  # cuts, boundaries
        expected = layout.locate(np.arange(start, stop))
        got = layout.locate_range(start, stop)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])


def test_the_layout_is_a_pure_function_of_its_inputs(schedule):
    positions = np.arange(3000, 3400)
    a = MixtureLayout(schedule, batch_size=8, block_size=64, seed=1).locate(positions)
    b = MixtureLayout(schedule, batch_size=8, block_size=64, seed=1, cached_blocks=1).locate(positions[::-1])
    np.testing.assert_array_equal(a[0], b[0][::-1])
    np.testing.assert_array_equal(a[1], b[1][::-1])
    other_seed = MixtureLayout(schedule, batch_size=8, block_size=64, seed=2).locate(positions)
    assert np.mean(other_seed[0] == a[0]) < 0.8


def test_the_sequence_is_pinned():
    # the order is part of the determinism promise: a change here breaks the resume of every mixture run
    layout = MixtureLayout(parse_train_weights({"x": 2, "y": 1}, ["x", "y"]), batch_size=4, block_size=8, seed=0)
    sources, indices = layout.locate(np.arange(16))
    assert sources.tolist() == [0, 1, 0, 1, 1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0]  # 5 x and 3 y per block of 8
    assert indices.tolist() == [0, 0, 1, 1, 2, 2, 3, 4, 3, 5, 6, 4, 5, 7, 8, 9]


def test_appending_a_stage_changes_nothing_before_it(schedule):
    layout = MixtureLayout(schedule, batch_size=6, block_size=16, seed=4)
    longer = MixtureLayout(schedule.with_stage(13, {"eval": 1}), batch_size=6, block_size=16, seed=4)
    old, new = layout.locate(np.arange(13 * 6)), longer.locate(np.arange(13 * 6))
    np.testing.assert_array_equal(old[0], new[0])
    np.testing.assert_array_equal(old[1], new[1])
    assert set(longer.locate(longer.step_positions(13))[0].tolist()) == {3}


def test_bad_layout_arguments():
    schedule = parse_train_weights({"x": 1}, ["x"])
    with pytest.raises(ValueError, match="batch_size must be a whole number"):
        MixtureLayout(schedule, batch_size=0)
    with pytest.raises(ValueError, match="block_size: must be a whole number"):
        MixtureLayout(schedule, batch_size=2, block_size=0)
    with pytest.raises(IndexError, match=">= 0"):
        MixtureLayout(schedule, batch_size=2).locate([-1])
