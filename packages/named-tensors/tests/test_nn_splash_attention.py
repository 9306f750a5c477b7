"""splash_attention (jax's Pallas TPU kernel, interpreted on this CPU) against plain jax.numpy, with gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import all_jaxpr_eqns, reference_attention

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Pos, KPos, HeadSize = Axis("batch", 2), Axis("position", 256), Axis("key_position", 256), Axis("head_size", 8)


def _rand(seed, *axes):
    return nt.named(jax.random.normal(jax.random.PRNGKey(seed), tuple(a.size for a in axes)), axes)


def _packed_ids():
    """Two rows of packed documents, the first ending in padding (-1)."""
    first = [0] * 100 + [1] * 120 + [-1] * 36
    second = [0] * 30 + [1] * 200 + [2] * 26
    return nt.named(jnp.asarray([first, second], jnp.int32), (Batch, Pos))


@pytest.mark.parametrize(
    ("kv_heads", "window", "packed", "cap"),
    [(4, None, False, None), (2, 100, False, 1.5), (2, None, True, None)],
    ids=["mha-causal", "gqa-window-softcap", "gqa-packed"],
)
def test_splash_equals_plain_attention_with_gradients(kv_heads, window, packed, cap):
    Heads = Axis("heads", 4)
    KVHeads = Axis("kv_heads", kv_heads) if kv_heads != Heads.size else Heads
    q = _rand(0, Batch, Pos, Heads, HeadSize)
    k = _rand(1, Batch, KPos, KVHeads, HeadSize)
    v = _rand(2, Batch, KPos, KVHeads, HeadSize)
    rows, cols = np.arange(Pos.size)[:, None], np.arange(KPos.size)[None, :]
    allowed = ((cols <= rows) & ((cols > rows - window) if window else True))[None, None]
    ids = _packed_ids() if packed else None
    if packed:
        raw = np.asarray(ids.array)
        allowed = allowed & (raw[:, :, None] == raw[:, None, :])[:, None]  # (batch, 1, position, key_position)

    def ours(q, k, v):
        return nn.splash_attention(
            Pos, KPos, HeadSize, q, k, v, sliding_window=window, segment_ids=ids, logits_soft_cap=cap
        ).array

    def plain(q, k, v):
        return reference_attention(q, k, v, jnp.asarray(allowed), soft_cap=cap)

    arrays = (q.array, k.array, v.array)
    out = ours(q, k, v)
    np.testing.assert_allclose(out, plain(*arrays), rtol=1e-5, atol=1e-5)
    cotangent = jax.random.normal(jax.random.PRNGKey(9), out.shape)
    got = jax.grad(lambda q, k, v: jnp.sum(ours(q, k, v) * cotangent), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(plain(*a) * cotangent), argnums=(0, 1, 2))(*arrays)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.array, w, rtol=1e-4, atol=1e-4)
    # No (position, key_position) scores in memory, forward or backward: only the kernels' blocks hold them.
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(ours(q, k, v))))(q).jaxpr
    eqns = list(all_jaxpr_eqns(jaxpr, skip=("pallas_call",)))
    assert any(e.primitive.name == "pallas_call" for e in eqns)
    assert not [e for e in eqns for o in e.outvars if o.aval.shape[-2:] == (256, 256)]


def test_lengths_and_segment_ids_the_kernel_cannot_take_are_named():
    Short = Axis("position", 100)
    Heads = Axis("heads", 2)
    q = _rand(0, Batch, Short, Heads, HeadSize)
    k = _rand(1, Batch, Short.alias("key_position"), Heads, HeadSize)
    with pytest.raises(ValueError, match="as many queries as keys, a multiple of 128; got 100 and 100"):
        nn.splash_attention("position", "key_position", HeadSize, q, k, k)
    q, k = _rand(0, Batch, Pos, Heads, HeadSize), _rand(1, Batch, KPos, Heads, HeadSize)
    with pytest.raises(ValueError, match=r"segment_ids must have the axis 'position' and otherwise only batch axes"):
        nn.splash_attention(
            Pos, KPos, HeadSize, q, k, k, segment_ids=_packed_ids().rename({"position": "key_position"})
        )
    with pytest.raises(TypeError, match="integer segment ids"):
        nn.splash_attention(Pos, KPos, HeadSize, q, k, k, segment_ids=_packed_ids().astype(jnp.float32))
    assert nn.splash_block_size(1024) == 512 and nn.splash_block_size(384) == 128 and nn.splash_block_size(100) is None


def test_a_sharded_batch_and_heads_run_the_kernel_per_device():
    """Under an axis mapping that shards the batch and the key heads, the kernel runs inside shard_map on each
    device's share (XLA would gather a Pallas kernel's inputs whole), with the same result."""
    Heads, KVHeads = Axis("heads", 4), Axis("kv_heads", 2)
    q = _rand(0, Batch, Pos, Heads, HeadSize)
    k = _rand(1, Batch, KPos, KVHeads, HeadSize)
    v = _rand(2, Batch, KPos, KVHeads, HeadSize)

    ids = _packed_ids()

    def attend(q, k, v):
        return nn.splash_attention(Pos, KPos, HeadSize, q, k, v, segment_ids=ids).array

    mesh = nt.make_mesh({"data": 2, "model": 2}, devices=jax.devices()[:4])
    with nt.axis_mapping({"batch": "data", "heads": "model", "kv_heads": "model"}, mesh=mesh):
        sharded = jax.jit(attend)(q, k, v)
        jaxpr = jax.make_jaxpr(attend)(q, k, v).jaxpr
    assert [e.primitive.name for e in jaxpr.eqns if e.primitive.name == "shard_map"] == ["shard_map"]
    np.testing.assert_allclose(sharded, attend(q, k, v), rtol=1e-6, atol=1e-6)
