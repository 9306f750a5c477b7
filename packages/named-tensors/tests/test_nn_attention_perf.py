"""Attention's layout and memory: plain MHA with `kv_heads` names, no score transposes, one softmax residual."""

import jax
import jax.numpy as jnp
import numpy as np
from _attention_reference import all_jaxpr_eqns

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Pos, KPos, HeadSize = Axis("batch", 2), Axis("position", 5), Axis("key_position", 7), Axis("head_size", 4)
Heads, KVHeads = Axis("heads", 3), Axis("kv_heads", 3)
SCORE_SIZE = Batch.size * Heads.size * Pos.size * KPos.size


def _rand(seed, *axes):
    return nt.named(jax.random.normal(jax.random.PRNGKey(seed), tuple(a.size for a in axes)), axes)


def _qkv(kv_axis):
    q = _rand(0, Batch, Pos, Heads, HeadSize)
    k = _rand(1, Batch, KPos, kv_axis, HeadSize)
    v = _rand(2, Batch, KPos, kv_axis, HeadSize)
    return q, k, v


def _loss(q, k, v, mask):
    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)
    return jnp.sum(jnp.sin(out.array))


def test_equal_size_kv_heads_is_plain_multi_head_attention():
    mask = nn.causal_mask(Pos, KPos, offset=2)
    q, k, v = _qkv(KVHeads)
    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)
    assert out.axis_names == q.axis_names
    k_h, v_h = (x.rename({"kv_heads": "heads"}) for x in (k, v))
    expected = nn.dot_product_attention(Pos, KPos, HeadSize, q, k_h, v_h, mask=mask)
    np.testing.assert_allclose(out.array, expected.array, rtol=1e-6, atol=1e-6)
    # No size-1 q_per_group axis anywhere: every array in the gradient's program has at most 4 dims.
    jaxpr = jax.make_jaxpr(jax.grad(_loss, argnums=(0, 1, 2)))(q, k, v, mask).jaxpr
    assert max(len(var.aval.shape) for eqn in all_jaxpr_eqns(jaxpr) for var in eqn.outvars) <= 4


def test_no_score_sized_transposes_forward_or_backward():
    q, k, v = _qkv(Heads)
    mask = nn.causal_mask(Pos, KPos, offset=2)
    jaxpr = jax.make_jaxpr(jax.grad(_loss, argnums=(0, 1, 2)))(q, k, v, mask).jaxpr
    transposed = [
        eqn.outvars[0].aval.shape
        for eqn in all_jaxpr_eqns(jaxpr)
        if eqn.primitive.name == "transpose" and np.prod(eqn.outvars[0].aval.shape) == SCORE_SIZE
    ]
    assert transposed == []


def _reference_masked_softmax(x, mask):
    y = jnp.where(mask, jax.nn.softmax(jnp.where(mask, x, -jnp.inf), axis=-1), 0.0)
    return jnp.where(jnp.any(mask, axis=-1, keepdims=True), y, 0.0)


def test_masked_softmax_gradient_and_fully_masked_rows():
    q, k, v = _qkv(Heads)
    allowed = np.tril(np.ones((Pos.size, KPos.size), bool), k=2)
    allowed[1] = False  # a fully masked query row
    mask = nt.named(jnp.asarray(allowed), (Pos, KPos))
    scale = 1.0 / np.sqrt(HeadSize.size)

    def reference(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
        w = _reference_masked_softmax(s, jnp.asarray(allowed))
        return jnp.sum(jnp.sin(jnp.einsum("bhqk,bkhd->bqhd", w, v)))

    ours = jax.grad(lambda *a: _loss(*a, mask), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(reference, argnums=(0, 1, 2))(q.array, k.array, v.array)
    for g, e in zip(ours, expected, strict=True):
        assert np.all(np.isfinite(g.array))
        np.testing.assert_allclose(g.array, e, rtol=1e-5, atol=1e-6)
    # The fully masked row gets an all-zero output and zero gradient for its query.
    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, mask=mask)
    assert np.all(out.array[:, 1] == 0.0)
    assert np.all(ours[0].array[:, 1] == 0.0)


def test_masked_softmax_saves_only_its_output():
    from named_tensors.nn.attention import _masked_softmax

    scores = _rand(3, Batch, Heads, Pos, KPos)
    mask = nn.causal_mask(Pos, KPos, offset=2)
    _, vjp = jax.vjp(lambda s: _masked_softmax(s, KPos, mask).array, scores)
    saved = [leaf for leaf in jax.tree_util.tree_leaves(vjp) if getattr(leaf, "size", 0) >= SCORE_SIZE]
    assert len(saved) == 1


def test_embed_closed_over_concrete_ids_under_jit():
    Vocab, Embed = Axis("vocab", 10), Axis("embed", 4)
    emb = nn.Embedding.init(Vocab, Embed, key=jax.random.PRNGKey(0))
    ids = nt.named(jnp.array([1, 2, 3]), (Axis("position", 3),))
    out = jax.jit(lambda: emb.embed(ids))()
    assert out.axis_names == ("position", "embed")
    np.testing.assert_allclose(out.array, emb.weight.array[jnp.array([1, 2, 3])])
    bad = nt.named(jnp.array([1, 2, 30]), (Axis("position", 3),))
    try:
        jax.jit(lambda: emb.embed(bad))()
    except ValueError as e:
        assert "outside [0, 10)" in str(e)
    else:
        raise AssertionError("a concrete out-of-range id closed over by jit should still be rejected")
