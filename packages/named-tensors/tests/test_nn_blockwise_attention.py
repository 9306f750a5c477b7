"""Blockwise attention against the direct reference and against dot_product_attention, forward and grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import reference_attention

import named_tensors as nt
from named_tensors import Axis, nn

# Odd sizes on purpose: 7 queries and 9 keys are multiples of none of the block sizes used below.
Batch, Pos, KPos, HeadSize = Axis("batch", 2), Axis("position", 7), Axis("key_position", 9), Axis("head_size", 4)
Heads, KVHeads = Axis("heads", 4), Axis("kv_heads", 2)
OFFSET = 2  # the 7 queries are the last 7 of the 9 keys
LENGTHS = np.array([6, 9])


def _rand(seed, *axes, dtype=jnp.float32):
    return nt.named(jax.random.normal(jax.random.PRNGKey(seed), tuple(a.size for a in axes)).astype(dtype), axes)


def _qkv(kv_axis=KVHeads, dtype=jnp.float32):
    return (
        _rand(0, Batch, Pos, Heads, HeadSize, dtype=dtype),
        _rand(1, Batch, KPos, kv_axis, HeadSize, dtype=dtype),
        _rand(2, Batch, KPos, kv_axis, HeadSize, dtype=dtype),
    )


def _reference_allowed():
    q = np.arange(7)[None, :, None] + OFFSET
    k = np.arange(9)[None, None, :]
    return jnp.asarray(((k <= q) & (k < LENGTHS[:, None, None]))[:, None])  # (B, 1, T, S)


def _padding():
    return nn.length_mask(nt.named(jnp.asarray(LENGTHS), (Batch,)), KPos)


@pytest.mark.parametrize("blocks", [(3, 2), (16, 16)], ids=["3x2", "one-block"])
def test_causal_padded_gqa_forward_and_gradients_match_reference_under_jit(blocks):
    q, k, v = _qkv()
    allowed = _reference_allowed()
    cotangent = _rand(9, Batch, Pos, Heads, HeadSize).array

    @jax.jit
    def blockwise(q, k, v):
        out = nn.blockwise_attention(
            Pos,
            KPos,
            HeadSize,
            q,
            k,
            v,
            mask=_padding(),
            causal=True,
            causal_offset=OFFSET,
            block_size=blocks[0],
            key_block_size=blocks[1],
        )
        return out

    def reference_loss(q, k, v):
        return jnp.sum(reference_attention(q, k, v, allowed) * cotangent)

    out = blockwise(q, k, v)
    assert out.axis_names == q.axis_names and out.dtype == jnp.float32
    np.testing.assert_allclose(out.array, reference_attention(q.array, k.array, v.array, allowed), rtol=1e-5, atol=1e-5)
    got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(blockwise(q, k, v).array * cotangent), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(reference_loss, argnums=(0, 1, 2))(q.array, k.array, v.array)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.array, w, rtol=1e-4, atol=1e-5)


def test_segments_bias_scale_and_traced_offset_match_plain_attention():
    q, k, v = _qkv(Heads)
    key_ids = nt.named(jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]]), (Batch, KPos))
    query_ids = nt.named(key_ids.array[:, 2:], (Batch, Pos))
    cotangent = _rand(9, Batch, Pos, Heads, HeadSize).array
    offset = jnp.int32(OFFSET)

    def plain(q, k, v, bias):
        mask = nn.and_masks(nn.causal_mask(Pos, KPos, offset=offset), nn.segment_mask(query_ids, key_ids))
        return nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask, bias=bias, scale=0.7)

    def blockwise(q, k, v, bias):
        return nn.blockwise_attention(
            Pos,
            KPos,
            HeadSize,
            q,
            k,
            v,
            bias=bias,
            causal=True,
            causal_offset=offset,
            query_segment_ids=query_ids,
            key_segment_ids=key_ids,
            scale=0.7,
            block_size=2,
            key_block_size=3,
        )

    def grads(fn, bias):
        def loss(q, k, v, b):
            return jnp.sum(fn(q, k, v, b).array * cotangent)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)

    # A (heads, key_position) bias like ALiBi, and a learned-looking (position, key_position) one.
    for bias in (nn.alibi_bias(Heads, KPos), _rand(11, Pos, KPos)):
        np.testing.assert_allclose(
            jax.jit(blockwise)(q, k, v, bias).array, plain(q, k, v, bias).array, rtol=1e-5, atol=1e-5
        )
        for g, w in zip(grads(blockwise, bias), grads(plain, bias), strict=True):
            assert g.axis_names == w.axis_names
            np.testing.assert_allclose(g.array, w.array, rtol=1e-4, atol=1e-5)


def test_dense_attention_any_axis_order_and_mqa():
    q, k, v = _qkv(Axis("kv_heads", 1))
    shuffled = nt.permute(q, ("heads", "head_size", "position", "batch"))
    out = nn.blockwise_attention(Pos, KPos, HeadSize, shuffled, k, v, block_size=4)
    assert out.axis_names == shuffled.axis_names
    np.testing.assert_allclose(
        nt.permute(out, q.axis_names).array, reference_attention(q.array, k.array, v.array), rtol=1e-5, atol=1e-5
    )


def test_bf16_inputs_and_fully_masked_rows():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    out = nn.blockwise_attention(
        Pos, KPos, HeadSize, q, k, v, mask=_padding(), causal=True, causal_offset=OFFSET, block_size=3
    )
    assert out.dtype == jnp.bfloat16
    plain = nn.dot_product_attention(
        Pos, KPos, HeadSize, q, k, v, mask=nn.and_masks(_padding(), nn.causal_mask(Pos, KPos, offset=OFFSET))
    )
    np.testing.assert_allclose(out.array.astype(jnp.float32), plain.array.astype(jnp.float32), atol=2e-2)

    q, k, v = _qkv()
    empty_first_row = nn.length_mask(nt.named(jnp.array([0, 9]), (Batch,)), KPos)
    out = nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, mask=empty_first_row, block_size=3)
    assert float(jnp.abs(out.array[0]).max()) == 0.0
    grad = jax.grad(
        lambda q: nt.sum(nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, mask=empty_first_row)).scalar()
    )(q)
    assert np.isfinite(grad.array).all() and float(jnp.abs(grad.array[0]).max()) == 0.0


def test_memory_is_linear_in_sequence_length():
    T = 1024
    P, K, D = Axis("position", T), Axis("key_position", T), Axis("head_size", 8)
    q = nt.named(jnp.ones((T, 8)), (P, D))
    k = nt.named(jnp.ones((T, 8)), (K, D))

    def forward(q, k):
        return nt.sum(nn.blockwise_attention(P, K, D, q, k, k, causal=True, block_size=64)).scalar()

    one_score_matrix = T * T * 4
    for fn in (forward, jax.grad(forward, argnums=(0, 1))):
        temp = jax.jit(fn).lower(q, k).compile().memory_analysis().temp_size_in_bytes
        assert temp < one_score_matrix / 8, f"{fn}: {temp} bytes of temporaries"


def test_blockwise_errors_are_clear():
    q, k, v = _qkv()
    ids = nt.named(jnp.zeros((2, 9), jnp.int32), (Batch, KPos))
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, block_size=0)
    with pytest.raises(ValueError, match="both query_segment_ids and key_segment_ids"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, key_segment_ids=ids)
    with pytest.raises(ValueError, match="query_segment_ids must have the axis 'position'"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, query_segment_ids=ids, key_segment_ids=ids)
    with pytest.raises(ValueError, match="value must have"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, *_qkv(Heads)[1:2], _rand(3, Batch, KPos, HeadSize))
    with pytest.raises(ValueError, match="different names"):
        nn.blockwise_attention(Pos, Pos, HeadSize, q, k, v)
    with pytest.raises(ValueError, match="causal_offset must be one int"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, causal=True, causal_offset=jnp.array([1, 2]))


def test_prefix_lm_matches_plain_attention():
    q, k, v = _qkv()
    prefix = nt.named(jnp.array([5, 0]), (Batch,))
    cotangent = _rand(9, Batch, Pos, Heads, HeadSize).array

    def plain(q, k, v):
        mask = nn.and_masks(_padding(), nn.prefix_lm_mask(Pos, KPos, prefix, offset=OFFSET))
        return nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)

    def blockwise(q, k, v):
        return nn.blockwise_attention(
            Pos,
            KPos,
            HeadSize,
            q,
            k,
            v,
            mask=_padding(),
            causal=True,
            causal_offset=OFFSET,
            prefix_length=prefix,
            block_size=2,
            key_block_size=2,
        )

    np.testing.assert_allclose(blockwise(q, k, v).array, plain(q, k, v).array, rtol=1e-5, atol=1e-5)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).array * cotangent), argnums=(0, 1, 2)))(q, k, v)

    for g, w in zip(grads(blockwise), grads(plain), strict=True):
        np.testing.assert_allclose(g.array, w.array, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="causal=True"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, prefix_length=3)


def test_sharded_batch_and_heads_give_the_unsharded_result():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if jax.device_count() < 4:  # an accelerator's own devices, under bench/device_check.py
        pytest.skip("needs 4 devices (CPU runs force 8)")
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("data", "model"))
    q, k, v = _qkv()
    spec = NamedSharding(mesh, PartitionSpec("data", None, "model", None))
    sharded = [nt.NamedArray(jax.device_put(x.array, spec), x.axes) for x in (q, k, v)]

    def attend(q, k, v):
        return nn.blockwise_attention(
            Pos, KPos, HeadSize, q, k, v, mask=_padding(), causal=True, causal_offset=OFFSET, block_size=3
        )

    out = jax.jit(attend)(*sharded)
    np.testing.assert_allclose(out.array, attend(q, k, v).array, rtol=1e-5, atol=1e-6)
    grads = jax.jit(jax.grad(lambda q, k, v: nt.sum(attend(q, k, v)).scalar(), argnums=(0, 1, 2)))(*sharded)
    assert all(np.isfinite(g.array).all() for g in grads)


def test_dropout_drops_whole_weights_and_its_gradient_is_right():
    from jax.test_util import check_grads

    q, k, _ = _qkv()
    # With the identity as values, the output row of each query is its (dropped) attention weights.
    ValueSize = Axis("value_size", KPos.size)
    identity = nt.named(jnp.eye(KPos.size), (KPos, ValueSize)).broadcast_to((Batch, KPos, KVHeads, ValueSize))
    kw = dict(mask=_padding(), causal=True, causal_offset=OFFSET, block_size=3, key_block_size=2)
    weights = nn.blockwise_attention(Pos, KPos, HeadSize, q, k, identity, **kw).array
    dropped = nn.blockwise_attention(
        Pos, KPos, HeadSize, q, k, identity, **kw, dropout_rate=0.5, dropout_key=jax.random.PRNGKey(4)
    ).array
    attended = np.asarray(weights) > 0
    kept = np.isclose(dropped, weights / 0.5, rtol=1e-5)
    assert (kept | (np.asarray(dropped) == 0))[attended].all()
    assert 0.3 < kept[attended].mean() < 0.7
    again = nn.blockwise_attention(
        Pos, KPos, HeadSize, q, k, identity, **kw, dropout_rate=0.5, dropout_key=jax.random.PRNGKey(4)
    )
    np.testing.assert_array_equal(again.array, dropped)
    off = nn.blockwise_attention(Pos, KPos, HeadSize, q, k, identity, **kw, dropout_rate=0.5, inference=True)
    np.testing.assert_array_equal(off.array, weights)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, k, identity, **kw, dropout_rate=0.5)

    _, _, v = _qkv()

    def attend(q, k, v):
        return nn.blockwise_attention(
            Pos, KPos, HeadSize, q, k, v, **kw, dropout_rate=0.3, dropout_key=jax.random.PRNGKey(5)
        ).array

    # Numerical derivatives of the (fixed-mask) function against the custom VJP.
    check_grads(attend, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)
