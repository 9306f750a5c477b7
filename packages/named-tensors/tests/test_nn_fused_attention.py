"""fused_attention (jax.nn.dot_product_attention, XLA's implementation on CPU) against dot_product_attention:
the same outputs and gradients for multi-head and grouped-query attention, causal, windowed and packed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Extra = Axis("batch", 2), Axis("extra", 3)
Pos, KPos, HeadSize = Axis("position", 9), Axis("key_position", 9), Axis("head_size", 8)
Heads, KVHeads = Axis("heads", 6), Axis("kv_heads", 2)


def _rand(seed, *axes):
    return nt.named(jax.random.normal(jax.random.PRNGKey(seed), tuple(a.size for a in axes)), axes)


def _both(q, k, v, ours_mask, *, scale, causal, window=None, fused_mask=None):
    """Ours (the mask spelled out) and fused (causal/window by flag), as arrays in the query's axis order."""
    ours = jax.jit(lambda q, k, v, m: nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, m, scale=scale))(
        q, k, v, ours_mask
    )
    fused = jax.jit(
        lambda q, k, v, m: nn.fused_attention(
            Pos, KPos, HeadSize, q, k, v, m, scale=scale, causal=causal, sliding_window=window,
            implementation="xla",
        )
    )(q, k, v, fused_mask)  # fmt: skip
    assert fused.axis_names == ours.axis_names == q.axis_names
    return ours.array, fused.array


@pytest.mark.parametrize("kv", [Heads, KVHeads], ids=["multi-head", "grouped-query"])
def test_causal_attention_and_its_gradients_equal_ours(kv):
    # The query's axes in an order of their own: the output comes back in it.
    q = _rand(0, Heads, Batch, Pos, Extra, HeadSize)
    k, v = _rand(1, Batch, Extra, KPos, kv, HeadSize), _rand(2, Extra, Batch, KPos, kv, HeadSize)
    ours, fused = _both(q, k, v, nn.causal_mask(Pos, KPos), scale=0.3, causal=True)
    np.testing.assert_allclose(fused, ours, rtol=1e-5, atol=1e-5)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v)))

    def fused_fn(q, k, v):
        return nn.fused_attention(Pos, KPos, HeadSize, q, k, v, causal=True, implementation="xla").array

    def ours_fn(q, k, v):
        return nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, nn.causal_mask(Pos, KPos)).array

    got = jax.jit(jax.grad(lambda *a: loss(fused_fn, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: loss(ours_fn, *a), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.array, w.array, rtol=1e-5, atol=1e-5)


def test_sliding_window_and_packed_segments_equal_ours():
    q = _rand(3, Batch, Pos, Heads, HeadSize)
    k, v = _rand(4, Batch, KPos, KVHeads, HeadSize), _rand(5, Batch, KPos, KVHeads, HeadSize)
    segments = nt.named(jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]]), (Batch, Pos))
    packed = nn.packed_causal_mask(segments)  # (batch, position, key_position), causal within each document
    window = nn.sliding_window_mask(Pos, KPos, 3)
    ours, fused = _both(q, k, v, packed & window, scale=None, causal=True, window=3, fused_mask=packed)
    np.testing.assert_allclose(fused, ours, rtol=1e-5, atol=1e-5)
    # a mask over the heads too (head 0 sees only its query and the key before it), with the batch's segments
    others = nt.named(jnp.arange(Heads.size) != 0, (Heads,))
    head_mask = others | nn.sliding_window_mask(Pos, KPos, 2)
    ours, fused = _both(q, k, v, packed & head_mask, scale=None, causal=True, fused_mask=packed & head_mask)
    np.testing.assert_allclose(fused, ours, rtol=1e-5, atol=1e-5)


def test_unknown_implementation_is_refused():
    q = _rand(6, Pos, HeadSize)
    k = _rand(7, KPos, HeadSize)
    with pytest.raises(ValueError, match=r"implementation must be one of \('xla', 'cudnn'\)"):
        nn.fused_attention(Pos, KPos, HeadSize, q, k, k, implementation="flash")
    # a single head, no batch: still the plain softmax attention
    ours, fused = _both(q, k, k, None, scale=None, causal=False)
    np.testing.assert_allclose(fused, ours, rtol=1e-5, atol=1e-5)
