"""Sliding windows, soft-capping, Gemma's (1 + w) RMSNorm and dynamic-NTK RoPE against plain jax.numpy."""

import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

_spec = importlib.util.spec_from_file_location(
    "_attention_reference", pathlib.Path(__file__).with_name("_attention_reference.py")
)
_ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ref)

Batch, Pos, KPos, HeadSize = Axis("batch", 2), Axis("position", 11), Axis("key_position", 11), Axis("head_size", 4)
Heads, KVHeads = Axis("heads", 4), Axis("kv_heads", 2)


def _rand(seed, *axes):
    return nt.named(jax.random.normal(jax.random.key(seed), tuple(a.size for a in axes)), axes)


def test_sliding_window_mask_keeps_the_last_window_keys():
    mask = nn.sliding_window_mask(Axis("position", 5), Axis("key_position", 7), 3, offset=2)
    q, k = np.arange(5)[:, None] + 2, np.arange(7)[None, :]
    np.testing.assert_array_equal(np.asarray(mask.array), k > q - 3)
    assert mask.axis_names == ("position", "key_position")
    assert nn.sliding_window_mask(Pos, KPos, None) is None
    assert bool(nn.sliding_window_mask(Pos, KPos, 0).array.all())  # <= 0: no limit


def test_soft_cap_squashes_scores_before_the_mask():
    q, k, v = (
        _rand(0, Batch, Pos, Heads, HeadSize),
        _rand(1, Batch, KPos, Heads, HeadSize),
        _rand(2, Batch, KPos, Heads, HeadSize),
    )
    q = q * 3.0  # scores large enough for the cap to matter
    causal = nn.causal_mask(Pos, KPos)
    out = nn.dot_product_attention(Pos, KPos, HeadSize, q, k, v, causal, logits_soft_cap=2.0)
    s = jnp.einsum("bthd,bshd->bhts", q.array, k.array) / 2.0
    s = 2.0 * jnp.tanh(s / 2.0)
    s = jnp.where(np.tril(np.ones((11, 11), bool)), s, -jnp.inf)
    expected = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v.array)
    np.testing.assert_allclose(np.asarray(out.array), np.asarray(expected), atol=1e-6)
    with pytest.raises(ValueError, match="must be positive"):
        nn.soft_cap(q, 0.0)
    assert nn.soft_cap(q, None) is q


def test_blockwise_attention_with_a_traced_window_and_a_soft_cap_equals_the_reference():
    q, k, v = (
        _rand(3, Batch, Pos, Heads, HeadSize),
        _rand(4, Batch, KPos, KVHeads, HeadSize),
        _rand(5, Batch, KPos, KVHeads, HeadSize),
    )
    q = q * 2.0

    def blockwise(q, k, v, window):
        out = nn.blockwise_attention(
            Pos,
            KPos,
            HeadSize,
            q,
            k,
            v,
            causal=True,
            sliding_window=window,
            logits_soft_cap=1.5,
            block_size=4,
            key_block_size=3,
        )
        return nt.sum(out * out).array

    def reference(q, k, v, window):
        group = q.array.shape[2] // k.array.shape[2]
        kk, vv = jnp.repeat(k.array, group, axis=2), jnp.repeat(v.array, group, axis=2)
        s = jnp.einsum("bthd,bshd->bhts", q.array, kk) / 2.0
        s = 1.5 * jnp.tanh(s / 1.5)
        t, u = np.arange(11)[:, None], np.arange(11)[None, :]
        s = jnp.where((u <= t) & ((u > t - window) | (window <= 0)), s, -jnp.inf)
        out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), vv)
        return jnp.sum(out * out)

    grad = jax.jit(jax.value_and_grad(blockwise, argnums=(0, 1, 2)))
    ref_grad = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))
    for window in (3, 0):  # a window of 3 (so whole key blocks are skipped) and none; one compiled program
        (value, grads), (ref_value, ref_grads) = grad(q, k, v, jnp.int32(window)), ref_grad(q, k, v, window)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g.array), np.asarray(r.array), atol=1e-5)
    with pytest.raises(ValueError, match="sliding_window needs causal=True"):
        nn.blockwise_attention(Pos, KPos, HeadSize, q, k, v, sliding_window=3)


def test_rms_norm_with_a_weight_offset_scales_by_one_plus_the_weight():
    Embed = Axis("embed", 6)
    x = _rand(6, Batch, Embed)
    norm = nn.RMSNorm.init(Embed, eps=1e-6, weight_offset=1.0)
    assert float(jnp.abs(norm.weight.array).max()) == 0.0  # the identity scale is stored as zero
    w = np.linspace(-0.5, 0.5, 6, dtype=np.float32)
    norm = nn.RMSNorm(nt.named(jnp.asarray(w), (Embed,)), (Embed,), 1e-6, True, 1.0)
    xs = np.asarray(x.array)
    rms = np.sqrt(np.mean(xs**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(norm(x).array), xs / rms * (1 + w[None, :]), rtol=1e-5)


def test_dynamic_ntk_rope_grows_theta_only_past_the_original_length():
    Size = Axis("head_size", 8)
    plain = nn.RotaryEmbeddings(8, 100.0)
    dynamic = nn.RotaryEmbeddings(8, 100.0, nn.DynamicNtkRopeScaling(2.0, 6))
    short = nt.arange(Axis("position", 6), dtype=jnp.int32)
    for a, b in zip(dynamic.cos_sin(short, Size), plain.cos_sin(short, Size), strict=True):
        np.testing.assert_array_equal(np.asarray(a.array), np.asarray(b.array))
    long = nt.arange(Axis("position", 9), dtype=jnp.int32)
    theta = 100.0 * (2.0 * 9 / 6 - 1.0) ** (8 / 6)
    inv = 1.0 / theta ** (np.arange(0, 8, 2) / 8)
    angles = np.arange(9)[:, None] * np.concatenate([inv, inv])[None, :]
    cos, _ = dynamic.cos_sin(long, Size)
    np.testing.assert_allclose(np.asarray(cos.array), np.cos(angles), atol=1e-5)
    assert not math.isclose(float(cos.array[-1, 1]), float(plain.cos_sin(long, Size)[0].array[-1, 1]))
