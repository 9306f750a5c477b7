"""Causal, padding, segment and prefix-LM masks against masks written out with numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Pos, KPos = Axis("batch", 2), Axis("position", 4), Axis("key_position", 6)


def test_causal_mask_with_offset_for_kv_cache():
    m = nn.causal_mask(Pos, KPos)
    assert m.axis_names == ("position", "key_position") and m.dtype == jnp.bool_
    q, k = np.arange(4)[:, None], np.arange(6)[None, :]
    np.testing.assert_array_equal(m.array, k <= q)
    # Four new queries after a cache of two tokens sit at positions 2..5.
    np.testing.assert_array_equal(nn.causal_mask(Pos, KPos, offset=2).array, k <= q + 2)
    traced = jax.jit(lambda t: nn.causal_mask(Pos, KPos, offset=t).array)(jnp.int32(1))
    np.testing.assert_array_equal(traced, k <= q + 1)
    per_row = nn.causal_mask(Pos, KPos, offset=nt.named(jnp.array([0, 2]), (Batch,)))
    np.testing.assert_array_equal(
        nt.permute(per_row, ("batch", "position", "key_position")).array,
        k[None] <= q[None] + np.array([0, 2])[:, None, None],
    )
    with pytest.raises(TypeError, match="integer offset"):
        nn.causal_mask(Pos, KPos, offset=nt.named(jnp.array([0.5, 2.0]), (Batch,)))
    with pytest.raises(ValueError, match="different names"):
        nn.causal_mask(Pos, Pos)


def test_length_and_segment_masks():
    lengths = nt.named(jnp.array([2, 5]), (Batch,))
    pad = nn.length_mask(lengths, KPos)
    assert pad.axis_names == ("batch", "key_position")
    np.testing.assert_array_equal(pad.array, np.arange(6)[None, :] < np.array([[2], [5]]))
    np.testing.assert_array_equal(nn.length_mask(3, KPos).array, np.arange(6) < 3)
    with pytest.raises(ValueError, match="NamedArray"):
        nn.length_mask(jnp.array([1, 2]), KPos)
    with pytest.raises(TypeError, match=r"^length_mask needs integer lengths, got dtype float32$"):
        nn.length_mask(nt.named(jnp.array([1.0, 2.0]), (Batch,)), KPos)

    ids = np.array([[0, 0, 1, 1], [0, 1, 1, 2]])
    q_ids = nt.named(jnp.asarray(ids), (Batch, Pos))
    k_ids = q_ids.rename({"position": "key_position"})
    seg = nn.segment_mask(q_ids, k_ids)
    assert seg.axis_names == ("batch", "position", "key_position")
    np.testing.assert_array_equal(seg.array, ids[:, :, None] == ids[:, None, :])
    with pytest.raises(TypeError, match="integer"):
        nn.segment_mask(q_ids.astype(jnp.float32), k_ids)


def test_prefix_lm_and_combinations():
    prefix = nt.named(jnp.array([0, 3]), (Batch,))
    m = nn.prefix_lm_mask(Pos, KPos, prefix)
    q, k = np.arange(4)[None, :, None], np.arange(6)[None, None, :]
    expected = (k <= q) | (k < np.array([0, 3])[:, None, None])
    np.testing.assert_array_equal(nt.permute(m, ("batch", "position", "key_position")).array, expected)

    causal = nn.causal_mask(Pos, KPos)
    pad = nn.length_mask(nt.named(jnp.array([1, 6]), (Batch,)), KPos)
    both = nn.and_masks(causal, None, pad)
    np.testing.assert_array_equal(
        nt.permute(both, ("batch", "position", "key_position")).array,
        (k <= q) & (k < np.array([1, 6])[:, None, None]),
    )
    either = nn.or_masks(causal, pad)
    np.testing.assert_array_equal(
        nt.permute(either, ("batch", "position", "key_position")).array,
        (k <= q) | (k < np.array([1, 6])[:, None, None]),
    )
    assert nn.and_masks(None, None) is None
    assert nn.or_masks(causal, None) is None


def test_packed_causal_mask_keeps_each_segment_causal_and_alone():
    ids = np.array([[0, 0, 0, 1, 1, 2, -1, -1], [0, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    mask = nn.packed_causal_mask(nt.named(jnp.asarray(ids), ("batch", "position")))
    assert mask.axis_names == ("batch", "position", "key_position")
    i, k = np.arange(8)[:, None], np.arange(8)[None, :]
    expected = (k <= i)[None] & (ids[:, :, None] == ids[:, None, :])
    np.testing.assert_array_equal(np.asarray(mask.array), expected)
    with pytest.raises(TypeError, match="integer NamedArray of segment ids"):
        nn.packed_causal_mask(nt.named(jnp.zeros(8), ("position",)))


def test_attention_mask_keeps_segment_ids_apart_and_materializes_them():
    """AttentionMask.packed holds the ids (for kernels that take them); its whole mask is the same-segment rule
    and-ed with any boolean mask given with &; it passes through jit as a pytree."""
    ids = np.array([[0, 0, 0, 1, 1, 2, -1, -1], [0, 1, 1, 1, 1, 1, 1, 1]], np.int32)
    segments = nt.named(jnp.asarray(ids), ("batch", "position"))
    packed = nn.AttentionMask.packed(segments)
    same = ids[:, :, None] == ids[:, None, :]
    whole = packed.materialize()
    assert whole.axis_names == ("batch", "position", "key_position")
    np.testing.assert_array_equal(np.asarray(whole.array), same)
    causal = nn.causal_mask(Axis("position", 8), Axis("key_position", 8))
    np.testing.assert_array_equal(np.asarray((whole & causal).array), np.asarray(nn.packed_causal_mask(segments).array))
    assert nn.split_mask(packed) == (segments, None) and nn.split_mask(causal) == (None, causal)

    # A boolean mask joins as the explicit part, in either order; the ids stay ids.
    keep = nt.named(jnp.asarray(np.arange(16).reshape(2, 8) % 3 != 1), ("batch", "key_position"))
    for combined in (nn.and_masks(keep, packed), nn.and_masks(packed, keep), packed & keep):
        assert isinstance(combined, nn.AttentionMask) and combined.segment_ids is segments
        np.testing.assert_array_equal(np.asarray(combined.materialize().array), same & np.asarray(keep.array)[:, None])
    # Two numberings: one stays ids, the other becomes the mask it means.
    other = nt.named(jnp.asarray((np.arange(16).reshape(2, 8) >= 4).astype(np.int32)), ("batch", "position"))
    both = packed & nn.AttentionMask.packed(other)
    halves = np.asarray(other.array)
    np.testing.assert_array_equal(
        np.asarray(both.materialize().array), same & (halves[:, :, None] == halves[:, None, :])
    )
    through_jit = jax.jit(lambda m: m)(packed)
    np.testing.assert_array_equal(np.asarray(through_jit.segment_ids.array), ids)
    with pytest.raises(TypeError, match="integer NamedArray of segment ids"):
        nn.AttentionMask.packed(nt.named(jnp.zeros(8), ("position",)))
