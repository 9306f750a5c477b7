"""dot_product_attention(causal=True): query blocks that skip the keys they cannot see, against plain jax.numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import all_jaxpr_eqns, reference_attention

import named_tensors as nt
from named_tensors import Axis, nn

Batch, HeadSize, Heads, KVHeads = Axis("batch", 2), Axis("head_size", 8), Axis("heads", 4), Axis("kv_heads", 2)


def _rand(seed, *axes):
    return nt.named(jax.random.normal(jax.random.PRNGKey(seed), tuple(a.size for a in axes)), axes)


def _inputs(q_len, k_len):
    Pos, KPos = Axis("position", q_len), Axis("key_position", k_len)
    q = _rand(0, Batch, Pos, Heads, HeadSize)
    k = _rand(1, Batch, KPos, KVHeads, HeadSize)
    v = _rand(2, Batch, KPos, KVHeads, HeadSize)
    lengths = np.array([k_len - 3, k_len])
    pad = nt.named(jnp.arange(k_len)[None, :] < jnp.asarray(lengths)[:, None], (Batch, KPos))
    bias = _rand(3, Heads, KPos)
    return Pos, KPos, q, k, v, pad, bias, lengths


def _allowed(q_len, k_len, offset, lengths):
    """(B, 1, T, S): causal by index with the offset, and the padding."""
    causal = np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + offset
    return jnp.asarray(causal[None, None] & (np.arange(k_len) < lengths[:, None])[:, None, None, :])


@pytest.mark.parametrize(
    ("q_len", "k_len", "offset", "blocks"),
    [
        (70, 70, 0, None),  # the default: 2 blocks of 35
        (70, 70, 0, 4),  # uneven: 18, 18, 18, 16
        (64, 70, 6, 3),  # queries are the last 64 of 70 keys
        (12, 12, 0, 12),  # one query per block
        (40, 40, -4, 5),  # the first 4 queries see no key at all
    ],
)
def test_causal_blocks_equal_the_masked_reference_with_gradients(q_len, k_len, offset, blocks):
    Pos, KPos, q, k, v, pad, bias, lengths = _inputs(q_len, k_len)
    allowed = _allowed(q_len, k_len, offset, lengths)
    cotangent = _rand(9, Batch, Pos, Heads, HeadSize).array

    @jax.jit
    def ours(q, k, v, bias):
        out = nn.dot_product_attention(
            Pos, KPos, HeadSize, q, k, v, pad, bias, causal=True, causal_offset=offset, query_blocks=blocks
        )
        assert out.axis_names == q.axis_names
        return jnp.sum(out.array * cotangent)

    # Rows that see no key are 0 in ours; the reference computes them over every key, then drops them.
    sees_some = jnp.any(allowed, -1, keepdims=True)

    def theirs(q, k, v, bias):
        out = reference_attention(q, k, v, allowed | ~sees_some, bias[None, :, None, :])
        return jnp.sum(jnp.where(sees_some.transpose(0, 2, 1, 3), out, 0.0) * cotangent)

    want = theirs(q.array, k.array, v.array, bias.array)
    np.testing.assert_allclose(ours(q, k, v, bias), want, rtol=1e-5, atol=1e-5)
    got = jax.grad(ours, argnums=(0, 1, 2, 3))(q, k, v, bias)
    want = jax.grad(theirs, argnums=(0, 1, 2, 3))(q.array, k.array, v.array, bias.array)
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(g.array).all()
        np.testing.assert_allclose(g.array, w, rtol=1e-4, atol=1e-5)


def _score_elements(fn, *args):
    """Elements of the attention scores: the dot outputs that do not end in the head size."""
    total = 0
    for eqn in all_jaxpr_eqns(jax.make_jaxpr(fn)(*args).jaxpr):
        shape = eqn.outvars[0].aval.shape
        if eqn.primitive.name == "dot_general" and shape[-1] != HeadSize.size:
            total += int(np.prod(shape))
    return total


def test_blocks_leave_out_the_keys_no_query_of_theirs_sees():
    Pos, KPos, q, k, v, *_ = _inputs(128, 128)

    def attend(blocks):
        return lambda q, k, v: (
            nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, causal=True, query_blocks=blocks).array
        )

    full = _score_elements(attend(1), q, k, v)
    heads = Batch.size * Heads.size
    assert full == heads * 128 * 128
    # The default at 128 positions is 2 blocks of 64 rows, against 64 and 128 keys: 3/4 of the scores; 4 blocks of
    # 32 rows see 32, 64, 96 and 128 keys: 10/16.
    assert _score_elements(attend(None), q, k, v) == heads * 64 * (64 + 128)
    assert _score_elements(attend(4), q, k, v) == heads * 32 * (32 + 64 + 96 + 128)
    np.testing.assert_allclose(attend(None)(q, k, v), attend(1)(q, k, v), rtol=1e-5, atol=1e-6)


def test_dropout_keeps_one_block_and_the_same_draw():
    Pos, KPos, q, k, v, pad, *_ = _inputs(64, 64)
    key = jax.random.PRNGKey(5)
    causal = nt.arange(Pos) >= nt.arange(KPos)
    blocked = nn.dot_product_attention(
        Pos, KPos, HeadSize, q, k, v, pad, causal=True, dropout_rate=0.3, dropout_key=key, query_blocks=4
    )
    masked = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, causal & pad, dropout_rate=0.3, dropout_key=key)
    np.testing.assert_array_equal(blocked.array, masked.array)


def test_causal_arguments_are_checked():
    Pos, KPos, q, k, v, *_ = _inputs(8, 8)
    with pytest.raises(ValueError, match="query_blocks must be a positive int"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, causal=True, query_blocks=0)
    with pytest.raises(TypeError, match="causal_offset must be a static int"):
        nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, causal=True, causal_offset=jnp.int32(2))
