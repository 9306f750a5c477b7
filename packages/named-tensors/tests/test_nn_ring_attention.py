"""Ring attention on CPU devices against plain jax.numpy attention: values and gradients, in f32, alone and in a
pipeline's shape (inside a scan of a vmap with spmd_axis_name)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_reference import reference_attention
from jax.sharding import Mesh

import named_tensors as nt
from named_tensors import Axis, nn

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (CPU runs force 8)")

Batch, Pos, KPos = Axis("batch", 2), Axis("position", 16), Axis("key_position", 16)
Heads, KVHeads, HeadSize = Axis("heads", 4), Axis("kv_heads", 2), Axis("head_size", 8)
CONTEXT = 4
# Device i holds chunks i and 2C-1-i of the sequence (the causal load balance): the order of the tokens on the ring.
CHUNK = Pos.size // (2 * CONTEXT)
BALANCED = np.concatenate(
    [np.r_[i * CHUNK : (i + 1) * CHUNK, (2 * CONTEXT - 1 - i) * CHUNK : (2 * CONTEXT - i) * CHUNK] for i in range(4)]
)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, CONTEXT), ("data", "context"))


def _inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, 16, 4, 8), jnp.float32)
    k = jax.random.normal(keys[1], (2, 16, 2, 8), jnp.float32)
    v = jax.random.normal(keys[2], (2, 16, 2, 8), jnp.float32)
    cotangent = jax.random.normal(keys[3], (2, 16, 4, 8), jnp.float32)
    # Two packed documents in row 0 (positions restart), one in row 1.
    segments = np.array([[0] * 7 + [1] * 9, [0] * 16])
    positions = np.array([list(range(7)) + list(range(9)), list(range(16))])
    return q, k, v, cotangent, segments, positions


def _allowed(positions, segments, window, packed):
    """(B, 1, T, S) boolean mask of the reference: causal by position, within the window, same segment."""
    qp, kp = positions[:, :, None], positions[:, None, :]
    allowed = kp <= qp
    if window is not None:
        allowed &= kp > qp - window
    if packed:
        allowed &= segments[:, :, None] == segments[:, None, :]
    return jnp.asarray(allowed[:, None])


def _ring(mesh, order, window, packed):
    """The ring attention of q, k, v whose positions are laid out along the ring in `order`."""
    mapping = {"batch": "data", "position": "context"}

    def attend(q, k, v, positions, segments):
        named = [
            nt.named(q[:, order], (Batch, Pos, Heads, HeadSize)),
            nt.named(k[:, order], (Batch, KPos, KVHeads, HeadSize)),
            nt.named(v[:, order], (Batch, KPos, KVHeads, HeadSize)),
        ]
        pos = nt.named(positions[:, order], (Batch, Pos))
        seg = nt.named(segments[:, order], (Batch, Pos))
        with nt.axis_mapping(mapping, mesh=mesh):
            named = nt.shard(named)
            out = nn.ring_attention(
                Pos, KPos, HeadSize, *named,
                query_positions=pos, key_positions=pos.rename({"position": "key_position"}),
                query_segment_ids=seg if packed else None,
                key_segment_ids=seg.rename({"position": "key_position"}) if packed else None,
                sliding_window=window,
            )  # fmt: skip
        inverse = np.argsort(order)
        return out.array[:, inverse]

    return attend


@pytest.mark.parametrize(
    "order, window, packed",
    [(BALANCED, None, False), (np.arange(16), None, True), (BALANCED, 5, True)],
    ids=["causal-balanced", "packed-natural-order", "window-packed-balanced"],
)
def test_ring_attention_equals_plain_attention_in_values_and_gradients(mesh, order, window, packed):
    q, k, v, cotangent, segments, positions = _inputs()
    # Packed rows' positions restart; unpacked, a row's positions are 0..T-1.
    positions = positions if packed else np.tile(np.arange(16), (2, 1))
    allowed = _allowed(positions, segments, window, packed)
    ring = jax.jit(_ring(mesh, order, window, packed))

    def reference(q, k, v):
        return reference_attention(q, k, v, allowed)

    def ring_of(q, k, v):
        return ring(q, k, v, jnp.asarray(positions, jnp.int32), jnp.asarray(segments, jnp.int32))

    np.testing.assert_allclose(ring_of(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-5)

    def grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent), argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(jax.jit(lambda *a: grads(ring_of))(q, k, v), grads(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_compiled_ring_permutes_blocks_and_gathers_no_keys(mesh):
    q, k, v, _, segments, positions = _inputs()
    ring = jax.jit(_ring(mesh, BALANCED, None, False))
    text = ring.lower(q, k, v, jnp.asarray(positions, jnp.int32), jnp.asarray(segments, jnp.int32)).compile()
    hlo = text.as_text()
    assert "collective-permute" in hlo
    assert "all-gather" not in hlo


def test_ring_attention_refuses_a_mapping_without_a_split_position(mesh):
    q, k, v, _, _, positions = _inputs()
    pos = nt.named(jnp.asarray(positions), (Batch, Pos))
    with nt.axis_mapping({"batch": "data"}, mesh=mesh), pytest.raises(ValueError, match="does not split 'position'"):
        nn.ring_attention(
            Pos, KPos, HeadSize, nt.named(q, (Batch, Pos, Heads, HeadSize)),
            nt.named(k, (Batch, KPos, KVHeads, HeadSize)), nt.named(v, (Batch, KPos, KVHeads, HeadSize)),
            query_positions=pos,
            key_positions=pos.rename({"position": "key_position"}),
        )  # fmt: skip


def test_ring_attention_inside_a_scan_of_a_stage_vmap_equals_plain_attention():
    # A pipeline's shape: each of 2 stages (vmap with spmd_axis_name="stage") runs the ring on its own slice, and a
    # scan feeds the stages' outputs back in as their queries. With shard_map's varying-axes checks on, jax's
    # batching of the ring's cond and rematerialised blocks failed here (mismatched cond branches, or a pvary over
    # "stage" rejected in the backward).
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("stage", "data", "context"))
    q, k, v, cotangent, segments, positions = _inputs()

    def per_stage(x):
        return jnp.stack([x, x[::-1] * 0.5])  # a different slice for each stage

    q, k, v, cotangent = per_stage(q), per_stage(k), per_stage(v), per_stage(cotangent)
    positions = np.tile(np.arange(16), (2, 1))
    order = np.arange(16)
    ring = _ring(mesh, order, None, False)
    allowed = _allowed(positions, segments, None, False)
    pos, seg = jnp.asarray(positions, jnp.int32), jnp.asarray(segments, jnp.int32)

    def ring_stage(q, k, v):
        return ring(q, k, v, pos, seg)

    def twice(stage_fn, q, k, v):
        def tick(x, _):
            return stage_fn(x, k, v), None

        return jax.lax.scan(tick, q, None, length=2)[0]

    def piped(q, k, v):
        return twice(jax.vmap(ring_stage, spmd_axis_name="stage"), q, k, v)

    def reference(q, k, v):
        return twice(jax.vmap(lambda q, k, v: reference_attention(q, k, v, allowed)), q, k, v)

    def value_and_grads(fn):
        out, backward = jax.vjp(fn, q, k, v)
        return out, backward(cotangent)

    # One compiled program for the values and the gradients (compiling is most of this test's time).
    got, want = jax.jit(lambda: value_and_grads(piped))(), value_and_grads(reference)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
