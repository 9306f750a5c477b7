"""dot_product_attention against a direct softmax(QK^T/sqrt(d) + mask)V reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import reference_attention

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Pos, KPos, HeadSize = Axis("batch", 2), Axis("position", 5), Axis("key_position", 7), Axis("head_size", 4)
Heads, KVHeads = Axis("heads", 4), Axis("kv_heads", 2)


def _rand(seed, *axes, dtype=jnp.float32):
    return nt.named(jax.random.normal(jax.random.PRNGKey(seed), tuple(a.size for a in axes)).astype(dtype), axes)


def _qkv(kv_axis=Heads, dtype=jnp.float32):
    q = _rand(0, Batch, Pos, Heads, HeadSize, dtype=dtype)
    k = _rand(1, Batch, KPos, kv_axis, HeadSize, dtype=dtype)
    v = _rand(2, Batch, KPos, kv_axis, HeadSize, dtype=dtype)
    return q, k, v


def _causal_padding_mask():
    # Keys: 2 cached tokens then the 5 queries (offset 2); batch row 0 has only 4 valid keys.
    causal = nn.causal_mask(Pos, KPos, offset=2)
    pad = nn.length_mask(nt.named(jnp.array([4, 7]), (Batch,)), KPos)
    allowed = (np.arange(7)[None, None, :] <= np.arange(5)[None, :, None] + 2) & (
        np.arange(7)[None, None, :] < np.array([4, 7])[:, None, None]
    )
    return nn.and_masks(causal, pad), jnp.asarray(allowed[:, None])  # reference: (B, 1, T, S)


def test_multi_head_with_causal_and_padding_mask():
    q, k, v = _qkv()
    mask, allowed = _causal_padding_mask()
    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)
    assert out.axis_names == q.axis_names
    expected = reference_attention(q.array, k.array, v.array, allowed)
    np.testing.assert_allclose(out.array, expected, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_with_segments_bias_and_scale():
    q, k, v = _qkv(KVHeads)
    ids = nt.named(jnp.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]]), (Batch, KPos))
    q_ids = nt.named(ids.array[:, 2:], (Batch, Pos))
    mask = nn.segment_mask(q_ids, ids)
    bias = _rand(7, Heads, KPos)
    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask, bias=bias, scale=0.3)
    allowed = (q_ids.array[:, :, None] == ids.array[:, None, :])[:, None]
    expected = reference_attention(q.array, k.array, v.array, allowed, bias.array[None, :, None, :], scale=0.3)
    np.testing.assert_allclose(out.array, expected, rtol=1e-5, atol=1e-5)


def test_query_axis_order_is_kept_and_mqa_works():
    q, k, v = _qkv(Axis("kv_heads", 1))
    shuffled = nt.permute(q, ("head_size", "heads", "batch", "position"))
    out = nn.dot_product_attention(Pos, KPos, HeadSize, shuffled, k, v)
    assert out.axis_names == ("head_size", "heads", "batch", "position")
    expected = reference_attention(q.array, k.array, v.array)
    np.testing.assert_allclose(nt.permute(out, q.axis_names).array, expected, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_softmax_upcast():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    mask, allowed = _causal_padding_mask()
    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)
    assert out.dtype == jnp.bfloat16
    f32 = [a.array.astype(jnp.float32) for a in (q, k, v)]
    expected = reference_attention(*f32, allowed)
    np.testing.assert_allclose(out.array.astype(jnp.float32), expected, rtol=3e-2, atol=3e-2)
    low = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask, upcast_softmax=False)
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.array.astype(jnp.float32), expected, rtol=6e-2, atol=6e-2)


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = _qkv()
    lengths = nt.named(jnp.array([0, 3]), (Batch,))  # batch row 0 has no valid key at all
    mask = nn.length_mask(lengths, KPos)

    def f(q):
        return nt.sum(nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)).scalar()

    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)
    assert float(jnp.abs(out.array[0]).max()) == 0.0
    np.testing.assert_allclose(
        out.array[1:], reference_attention(q.array[1:], k.array[1:, :3], v.array[1:, :3]), rtol=1e-5, atol=1e-5
    )
    assert np.isfinite(jax.grad(f)(q).array).all()


def test_gradients_match_reference_under_jit():
    q, k, v = _qkv(KVHeads)
    mask, allowed = _causal_padding_mask()
    cotangent = _rand(9, Batch, Pos, Heads, HeadSize).array

    @jax.jit
    def ours(q, k, v):
        out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)
        return jnp.sum(out.array * cotangent)

    def theirs(q, k, v):
        return jnp.sum(reference_attention(q, k, v, allowed) * cotangent)

    got = jax.grad(ours, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(theirs, argnums=(0, 1, 2))(q.array, k.array, v.array)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.array, w, rtol=1e-4, atol=1e-5)


def test_dropout_on_weights():
    q, k, v = _qkv()
    plain = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v)
    dropped = nn.dot_product_attention(
        Pos, KPos, HeadSize, q, k, v, dropout_rate=0.5, dropout_key=jax.random.PRNGKey(3)
    )
    assert not np.allclose(plain.array, dropped.array)
    same = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, dropout_rate=0.5, inference=True)
    np.testing.assert_array_equal(same.array, plain.array)
    with pytest.raises(ValueError, match="PRNG key"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, dropout_rate=0.5)


def test_attention_errors_are_clear():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="different names"):
        nn.dot_product_attention(Pos, Pos, HeadSize, q, k.rename({"key_position": "position"}), v)
    with pytest.raises(ValueError, match="key needs axis 'key_position'"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, q, v)
    with pytest.raises(ValueError, match="mask has axes \\['layers'\\]"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=nt.named(jnp.ones((3,), bool), ("layers",)))
    with pytest.raises(TypeError, match="boolean"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=nn.causal_mask(Pos, KPos).astype(jnp.int32))
    with pytest.raises(ValueError, match="multiple of"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, *_qkv(Axis("kv_heads", 3))[1:])
    with pytest.raises(TypeError, match="dtype"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="not in the query"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, *_qkv(Axis("groups", 4))[1:])


def test_group_query_heads_is_kv_major_and_round_trips():
    x = nt.named(jnp.arange(2 * 6).reshape(2, 6), (Batch, Axis("heads", 6)))
    grouped = nn.group_query_heads(x, Axis("kv_heads", 3))
    assert grouped.axis_names == ("batch", "kv_heads", "q_per_group")
    # Query head h sits at (h // 2, h % 2): kv head 1 serves query heads 2 and 3, as HF's repeat_kv does.
    np.testing.assert_array_equal(grouped.array[0, 1], [2, 3])
    back = nn.ungroup_query_heads(grouped, Axis("heads", 6))
    np.testing.assert_array_equal(back.array, x.array)
    with pytest.raises(ValueError, match="multiple of"):
        nn.group_query_heads(x, Axis("kv_heads", 4))
    with pytest.raises(ValueError, match="Cannot merge"):
        nn.ungroup_query_heads(grouped, Axis("heads", 5))


@pytest.mark.parametrize("kv_axis", [Heads, KVHeads], ids=["multi-head", "grouped"])
def test_attention_sinks_take_their_share_of_each_row_with_causal_blocks(kv_axis):
    # gpt-oss: softmax over [scores, sink] per head, the sink's column dropped. Reference in plain jax.numpy,
    # the (B, H, T, S) scores with an extra column, with a causal mask (queries at offset 2) and padding.
    q, k, v = _qkv(kv_axis)
    sinks = _rand(9, Heads) * 3.0
    mask, allowed = _causal_padding_mask()
    group = Heads.size // kv_axis.size
    kk, vv = (jnp.repeat(jnp.transpose(x.array, (0, 2, 1, 3)), group, axis=1) for x in (k, v))  # (B, H, S, D)
    scores = jnp.einsum("bthd,bhsd->bhts", q.array, kk) * 0.5
    scores = jnp.where(allowed, scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks.array[None, :, None, None], (*scores.shape[:3], 1))
    weights = jax.nn.softmax(jnp.concatenate([scores, sink], -1), axis=-1)[..., :-1]
    expected = jnp.einsum("bhts,bhsd->bthd", weights, vv)
    causal_pad = nn.length_mask(nt.named(jnp.array([4, 7]), (Batch,)), KPos)
    for out in (
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask, sinks=sinks),
        # The same by index, in blocks of queries that each see only their keys.
        nn.dot_product_attention(
            Pos, KPos, HeadSize, q, k, v, mask=causal_pad, sinks=sinks, causal=True, causal_offset=2, query_blocks=2
        ),
    ):
        assert out.axis_names == q.axis_names
        np.testing.assert_allclose(out.array, expected, rtol=1e-5, atol=1e-5)
    assert float(weights.sum(-1).max()) < 1.0  # the sinks really took some weight
    grad = jax.grad(lambda s: nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask, sinks=s).array.sum())
    expected_grad = jax.grad(
        lambda s: jnp.einsum(
            "bhts,bhsd->bthd",
            jax.nn.softmax(
                jnp.concatenate([scores, jnp.broadcast_to(s[None, :, None, None], sink.shape)], -1), axis=-1
            )[..., :-1],
            vv,
        ).sum()
    )(sinks.array)
    np.testing.assert_allclose(grad(sinks).array, expected_grad, rtol=1e-4, atol=1e-5)


def test_sinks_need_one_per_query_head():
    q, k, v = _qkv(KVHeads)
    with pytest.raises(ValueError, match="sinks must be a NamedArray with the one axis 'heads'"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, sinks=_rand(3, KVHeads))
