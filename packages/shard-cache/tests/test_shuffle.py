import itertools

import numpy as np
import pytest

from shard_cache import EraShuffle, FeistelPermutation, process_slice


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4097])
def test_feistel_is_a_bijection_of_the_range(n):
    perm = FeistelPermutation(n, seed=123)(np.arange(n))
    np.testing.assert_array_equal(np.sort(perm), np.arange(n))


def test_feistel_is_a_pure_function_of_n_and_seed():
    a = FeistelPermutation(5000, seed=7)
    np.testing.assert_array_equal(a(np.arange(5000)), FeistelPermutation(5000, seed=7)(np.arange(5000)))
    # any index maps alone to the same place as in the whole permutation
    whole = a(np.arange(5000))
    assert [int(a(i)) for i in (0, 4999, 2500)] == [whole[0], whole[4999], whole[2500]]
    other = FeistelPermutation(5000, seed=8)(np.arange(5000))
    assert np.mean(other == whole) < 0.01
    # a real shuffle: positions move far, not by a small offset
    assert np.abs(whole - np.arange(5000)).mean() > 1000
    with pytest.raises(IndexError):
        a(np.array([5000]))


def test_era_shuffle_is_a_permutation_whose_eras_each_mix_the_last_spread_eras():
    total, era, spread = 1000, 20, 4
    shuffle = EraShuffle(seed=1, era_length=era, spread=spread)
    shuffle.extend(total, total)
    assert shuffle.complete and shuffle.covered == total
    order = shuffle(np.arange(total))
    np.testing.assert_array_equal(np.sort(order), np.arange(total))  # every example exactly once
    starts = shuffle.era_starts()
    for u, (begin, end) in enumerate(itertools.pairwise(starts)):
        source = order[begin:end] // era  # the stream eras this output era draws from
        assert source.min() >= u - spread + 1 and source.max() <= u
        if spread <= u < total // era:  # past the ramp: about one era, drawn about evenly from the last `spread`
            assert abs((end - begin) - era) <= era // 2
            assert set(source.tolist()) == set(range(u - spread + 1, u + 1))
            np.testing.assert_array_equal(np.sort(order[begin:end]), shuffle.members(u))
    # a document's examples (here: 20 consecutive ones) reach training over several eras, not in one
    era_of_position = np.searchsorted(starts, np.argsort(order), side="right") - 1
    spans = [len(set(era_of_position[e : e + era].tolist())) for e in range(0, total - era, era)]
    assert np.median(spans) == spread
    with pytest.raises(IndexError):
        shuffle(np.array([total]))
    again = EraShuffle(seed=1, era_length=era, spread=spread)
    again.extend(total, total)
    np.testing.assert_array_equal(again(np.arange(total)), order)
    other = EraShuffle(seed=2, era_length=era, spread=spread)
    other.extend(total, total)
    assert np.mean(other(np.arange(total)) == order) < 0.1


def test_era_shuffle_order_does_not_depend_on_when_examples_were_committed():
    total = 1234
    whole = EraShuffle(seed=4, era_length=30, spread=5)
    whole.extend(total, total)
    expected = whole(np.arange(total))
    rng = np.random.default_rng(0)
    for _ in range(3):  # readers that look at different moments of the build
        growing = EraShuffle(seed=4, era_length=30, spread=5)
        committed = covered = 0
        while not growing.complete:
            committed = min(total, committed + int(rng.integers(0, 200)))
            growing.extend(committed, total if committed == total else None)
            assert covered <= growing.covered <= committed  # only committed examples, and never taken back
            new = np.arange(covered, growing.covered)
            np.testing.assert_array_equal(growing(new), expected[new])
            covered = growing.covered
        np.testing.assert_array_equal(growing(np.arange(total)), expected)
    # an era whose stream era is not complete is not laid out: positions past it are refused, not guessed
    early = EraShuffle(seed=4, era_length=30, spread=5)
    early.extend(100, None)
    assert 0 < early.covered < 100
    with pytest.raises(IndexError, match="laid out only"):
        early(np.array([early.covered]))


def test_process_slices_partition_a_global_batch():
    batch = np.arange(24, 36)
    for count in (1, 2, 3, 4):
        np.testing.assert_array_equal(np.concatenate([process_slice(batch, p, count) for p in range(count)]), batch)
    with pytest.raises(ValueError, match="does not split evenly"):
        process_slice(batch, 0, 5)
