"""Rotary embeddings and ALiBi against formulas written out here, plus Hugging Face parity when installed."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Pos, Heads, HeadSize = Axis("batch", 2), Axis("position", 5), Axis("heads", 3), Axis("head_size", 8)


def _reference_inv_freq(head_size, theta, scaling=None):
    """Rotary frequencies from the equations (float64), with the llama3 piecewise rule."""
    inv = 1.0 / theta ** (np.arange(0, head_size, 2) / head_size)
    if scaling is None:
        return inv
    if isinstance(scaling, nn.LinearRopeScaling):
        return inv / scaling.factor
    wavelen = 2 * math.pi / inv
    low_wl = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wl = scaling.original_max_position_embeddings / scaling.high_freq_factor
    out = []
    for f, wl in zip(inv, wavelen, strict=True):
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / scaling.factor)
        else:
            s = (scaling.original_max_position_embeddings / wl - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            out.append((1 - s) * f / scaling.factor + s * f)
    return np.array(out)


def _reference_rope(x, positions, inv_freq):
    """x (..., T, D) rotated with pairs (i, i + D/2) by angle position * inv_freq[i]."""
    half = x.shape[-1] // 2
    ang = positions[:, None] * inv_freq[None, :]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


LLAMA3 = nn.Llama3RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


@pytest.mark.parametrize("scaling", [None, nn.LinearRopeScaling(4.0), LLAMA3], ids=["none", "linear", "llama3"])
def test_inverse_frequencies(scaling):
    # head_size 64 with theta 10000 spans wavelengths on both sides of the llama3 thresholds (16 and 64).
    rope = nn.RotaryEmbeddings(64, 10000.0, scaling)
    np.testing.assert_allclose(rope.inverse_frequencies(), _reference_inv_freq(64, 10000.0, scaling), rtol=2e-6)


def test_llama3_scaling_covers_all_three_regimes():
    inv = _reference_inv_freq(64, 10000.0)
    wl = 2 * math.pi / inv
    assert (wl < 16).any() and (wl > 64).any() and ((wl >= 16) & (wl <= 64)).any()


def test_rotary_rotates_queries_with_batch_positions_and_keeps_axis_order():
    rope = nn.RotaryEmbeddings(8, 500.0)
    x = nt.named(jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5, 8)), (Batch, Heads, Pos, HeadSize))
    positions = nt.named(jnp.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]), (Batch, Pos))
    y = rope(x, positions)
    assert y.axis_names == x.axis_names and y.dtype == x.dtype
    inv = _reference_inv_freq(8, 500.0)
    for b in range(2):
        ref = _reference_rope(np.asarray(x.array[b]), np.asarray(positions.array[b], np.float64), inv)
        np.testing.assert_allclose(y.array[b], ref, rtol=1e-5, atol=1e-5)


def test_rotary_relative_property_and_bf16():
    rope = nn.RotaryEmbeddings(8, 10000.0)
    q = nt.named(jax.random.normal(jax.random.PRNGKey(1), (8,)), (HeadSize,))
    k = nt.named(jax.random.normal(jax.random.PRNGKey(2), (8,)), (HeadSize,))

    def at(v, p):
        v = v.broadcast_to((Axis("position", 1), HeadSize))
        return rope(v, nt.named(jnp.array([p]), ("position",)))

    # Scores depend only on the distance between positions.
    s1 = nt.dot(at(q, 3), at(k, 1), axis=None).scalar()
    s2 = nt.dot(at(q, 10), at(k, 8), axis=None).scalar()
    np.testing.assert_allclose(s1, s2, rtol=1e-5)
    xb = nt.named(jnp.ones((5, 8), jnp.bfloat16), (Pos, HeadSize))
    assert rope(xb, nt.named(jnp.arange(5), (Pos,))).dtype == jnp.bfloat16


def test_rotary_errors_and_hf_config():
    with pytest.raises(ValueError, match="even"):
        nn.RotaryEmbeddings(7)
    rope = nn.RotaryEmbeddings(8)
    x = nt.named(jnp.ones((5, 8)), (Pos, HeadSize))
    with pytest.raises(ValueError, match="not axes of x"):
        rope(x, nt.named(jnp.arange(5), ("key_position",)))
    with pytest.raises(TypeError, match="integer"):
        rope(x, nt.named(jnp.arange(5.0), (Pos,)))
    with pytest.raises(ValueError, match="rotary expects 4"):
        nn.RotaryEmbeddings(4)(x, nt.named(jnp.arange(5), (Pos,)))
    cfg = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert nn.RotaryEmbeddings.from_hf_config(64, 10000.0, cfg) == nn.RotaryEmbeddings(64, 10000.0, LLAMA3)
    assert nn.RotaryEmbeddings.from_hf_config(64, None, {"rope_type": "default", "rope_theta": 5.0}).theta == 5.0
    assert nn.RotaryEmbeddings.from_hf_config(64, 1e4, {"type": "linear", "factor": 2.0}).scaling.factor == 2.0
    with pytest.raises(ValueError, match="Unsupported rope scaling type 'longrope'"):
        nn.RotaryEmbeddings.from_hf_config(64, 1e4, {"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match=r"'yarn' needs \['original_max_position_embeddings'\]"):
        nn.RotaryEmbeddings.from_hf_config(64, 1e4, {"rope_type": "yarn", "factor": 2.0})
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16}
    assert nn.RotaryEmbeddings.from_hf_config(64, 1e4, yarn).scaling == nn.YarnRopeScaling(4.0, 32, beta_fast=16)
    dynamic = nn.RotaryEmbeddings.from_hf_config(64, 1e4, {"rope_type": "dynamic", "factor": 2.0,
                                                           "max_position_embeddings": 8})  # fmt: skip
    assert dynamic.scaling == nn.DynamicNtkRopeScaling(2.0, 8)


def _reference_mpt_slopes(n, max_bias=8.0):
    padded = 2 ** math.ceil(math.log2(n))
    slopes = [2.0 ** (-max_bias * (i + 1) / padded) for i in range(padded)]
    if padded != n:
        slopes = (slopes[1::2] + slopes[0::2])[:n]
    return np.array(slopes)


@pytest.mark.parametrize("n", [1, 4, 6, 12])
def test_alibi_slopes_follow_mpt(n):
    np.testing.assert_allclose(nn.alibi_slopes(Axis("heads", n)).array, _reference_mpt_slopes(n), rtol=1e-6)


def test_alibi_bias_forms():
    H, K, Q = Axis("heads", 6), Axis("key_position", 5), Axis("position", 4)
    slopes = _reference_mpt_slopes(6)
    causal = nn.alibi_bias(H, K)
    assert causal.axis_names == ("heads", "key_position")
    np.testing.assert_allclose(causal.array, slopes[:, None] * (np.arange(5) - 4)[None, :], rtol=1e-6)
    full = nn.alibi_bias(H, K, QPos=Q)
    assert full.axis_names == ("heads", "position", "key_position")
    dist = -np.abs(np.arange(4)[:, None] - np.arange(5)[None, :])
    np.testing.assert_allclose(full.array, slopes[:, None, None] * dist[None], rtol=1e-6)
    assert nn.alibi_bias(H, K, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="at least one head"):
        nn.alibi_slopes(Axis("heads", 0))


def test_parity_with_transformers_when_installed():
    torch = pytest.importorskip("torch")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    mpt = pytest.importorskip("transformers.models.mpt.modeling_mpt")
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    hf_inv, _ = rope_utils._compute_llama3_parameters(config, "cpu")
    np.testing.assert_allclose(
        nn.RotaryEmbeddings(64, 10000.0, LLAMA3).inverse_frequencies(), hf_inv.numpy(), rtol=1e-6
    )
    # The whole rotation, HF's rotate-half layout included: queries (batch, heads, position, head_size).
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    x = np.array(jax.random.normal(jax.random.PRNGKey(3), (2, 4, 5, 64)), np.float32)  # writable, for torch
    # Frequencies agree with HF's to 1 ulp (library pow/division rounding), so the angle error grows with
    # the position: positions up to a few hundred keep it far below the tolerance.
    positions = np.array([[0, 1, 2, 3, 4], [3, 9, 100, 200, 300]])
    cos, sin = llama.LlamaRotaryEmbedding(config)(torch.from_numpy(x), torch.from_numpy(positions))
    hf_rotated, _ = llama.apply_rotary_pos_emb(torch.from_numpy(x), torch.from_numpy(x), cos, sin)
    rope = nn.RotaryEmbeddings.from_hf_config(64, None, config.rope_parameters)
    ours = rope(
        nt.named(jnp.asarray(x), ("batch", "heads", "position", "head_size")),
        nt.named(jnp.asarray(positions), ("batch", "position")),
    )
    np.testing.assert_allclose(ours.array, hf_rotated.numpy(), rtol=1e-5, atol=2e-5)
    for n in (4, 6):
        hf = mpt.build_mpt_alibi_tensor(n, 5).numpy()  # (heads, 1, key_position)
        ours = nn.alibi_bias(Axis("heads", n), Axis("key_position", 5)).array
        np.testing.assert_allclose(ours, hf[:, 0, :], rtol=1e-6)
