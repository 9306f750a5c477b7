"""fused_attention (jax.nn.dot_product_attention, XLA's implementation on CPU) against dot_product_attention:
the same outputs and gradients for multi-head and grouped-query attention, causal, windowed and packed."""

from functools import partial

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


def _recording_attention(monkeypatch, implementation=None):
    """Patch jax.nn.dot_product_attention to record each mask's shape; `implementation` overrides the caller's."""
    shapes, real = [], jax.nn.dot_product_attention

    def record(*args, mask=None, **kwargs):
        shapes.append(None if mask is None else mask.shape)
        if implementation is not None:
            kwargs["implementation"] = implementation
        return real(*args, mask=mask, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", record)
    return shapes


@pytest.mark.parametrize("over", ["keys", "queries"])
def test_cudnn_is_handed_a_mask_over_every_query_and_key(monkeypatch, over):
    # jax's cuDNN rule refuses a bias (the mask becomes one) shorter than the queries or keys (jax-ml/jax#28974).
    # Lowering for CUDA runs that rule here on CPU once jax believes cuDNN is installed.
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90100)
    shapes = _recording_attention(monkeypatch)
    QP, KP, D, H = Axis("position", 128), Axis("key_position", 128), Axis("head_size", 64), Axis("heads", 2)
    q = nt.named(jnp.zeros((2, 128, 2, 64), jnp.bfloat16), (Batch, QP, H, D))
    k = nt.named(jnp.zeros((2, 128, 2, 64), jnp.bfloat16), (Batch, KP, H, D))
    if over == "keys":  # forgetful causal masking's draw
        mask = nn.forgetful_causal_mask(KP, 0.5, key=jax.random.PRNGKey(0), batch_axes=(Batch,))
    else:
        mask = nt.named(jnp.arange(2 * 128).reshape(2, 128) % 3 != 1, (Batch, QP))

    def loss(q, k, v, m):
        out = nn.fused_attention(QP, KP, D, q, k, v, m, causal=True, implementation="cudnn")
        return jnp.sum(out.array.astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, mask).lower(lowering_platforms=("cuda",))
    assert "__cudnn$fmhaScaleBiasSoftmaxBackward" in lowered.as_text()
    assert shapes == [(2, 1, 128, 128)]  # batch kept, heads 1: the only copy is over the missing positions


def test_cudnn_broadcast_mask_keeps_the_result(monkeypatch):
    # The cuDNN call run by XLA's implementation instead: the spread mask must select the same keys as ours.
    shapes = _recording_attention(monkeypatch, implementation="xla")
    q = _rand(8, Batch, Pos, Heads, HeadSize)
    k, v = _rand(9, Batch, KPos, KVHeads, HeadSize), _rand(10, Batch, KPos, KVHeads, HeadSize)
    keep = nn.forgetful_causal_mask(KPos, 0.5, key=jax.random.PRNGKey(1), batch_axes=(Batch,))
    ours = jax.jit(lambda q, k, v, m: nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, m))(
        q, k, v, keep & nn.causal_mask(Pos, KPos)
    )

    def fused(implementation):
        attend = partial(nn.fused_attention, Pos, KPos, HeadSize, causal=True, implementation=implementation)
        return jax.jit(attend)(q, k, v, keep).array

    for implementation in ("cudnn", "xla"):
        np.testing.assert_allclose(fused(implementation), ours.array, rtol=1e-5, atol=1e-5)
    # XLA broadcasts the mask itself: it keeps its size-1 query axis there.
    assert shapes == [(Batch.size, 1, Pos.size, KPos.size), (Batch.size, 1, 1, KPos.size)]
