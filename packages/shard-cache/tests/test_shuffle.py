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


def test_era_shuffle_permutes_within_each_era():
    shuffle = EraShuffle(seed=1, era_length=10)
    out = shuffle(np.arange(35), final_n=35)
    for start in range(0, 35, 10):
        block = out[start : start + 10]
        np.testing.assert_array_equal(np.sort(block), np.arange(start, min(start + 10, 35)))
    # a complete era maps the same before the final size is known
    np.testing.assert_array_equal(shuffle(np.arange(20), final_n=None), out[:20])
    with pytest.raises(IndexError):
        shuffle(np.array([35]), final_n=35)


def test_process_slices_partition_a_global_batch():
    batch = np.arange(24, 36)
    for count in (1, 2, 3, 4):
        np.testing.assert_array_equal(np.concatenate([process_slice(batch, p, count) for p in range(count)]), batch)
    with pytest.raises(ValueError, match="does not split evenly"):
        process_slice(batch, 0, 5)
