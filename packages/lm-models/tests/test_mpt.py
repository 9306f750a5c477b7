"""MPT against a plain jax.numpy forward pass (ALiBi as MPT builds it, clip_qkv, no biases), plus config errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lm_models as lm
import named_tensors as nt
from named_tensors import Axis

VOCAB = Axis("vocab", 64)


def arr(x: nt.NamedArray, *order: str) -> jax.Array:
    if x.has_axis("layers"):
        order = ("layers", *order)
    return nt.permute(x, order).array


def mpt_alibi_slopes(num_heads: int, max_bias: float) -> np.ndarray:
    """MPT's slopes: powers of 2^(-max_bias/n) for n the next power of two, odd-indexed ones first if padded."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / 2.0 ** (np.arange(1, n + 1) * max_bias / n)
    if n != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def layer_norm_no_bias(x, w, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w


def reference_mpt(model: lm.MptLMHeadModel, ids: np.ndarray) -> np.ndarray:
    c = model.config
    H, D = c.num_heads, c.hidden_dim // c.num_heads
    seq = ids.shape[1]
    wte = arr(model.wte.weight, "vocab", "embed")
    x = wte[ids]
    b = model.blocks.stacked
    q_pos, k_pos = np.arange(seq)[:, None], np.arange(seq)[None, :]
    # The textbook ALiBi: -slope * distance to each earlier key.
    alibi = -mpt_alibi_slopes(H, c.alibi_bias_max)[:, None, None] * (q_pos - k_pos)[None]
    causal = q_pos >= k_pos
    for i in range(c.num_layers):
        h = layer_norm_no_bias(x, arr(b.norm_1.weight, "embed")[i], c.layer_norm_epsilon)
        q = jnp.einsum("bse,hde->bshd", h, arr(b.attn.q_proj.weight, "heads", "head_size", "embed")[i])
        k = jnp.einsum("bse,hde->bshd", h, arr(b.attn.k_proj.weight, "kv_heads", "head_size", "embed")[i])
        v = jnp.einsum("bse,hde->bshd", h, arr(b.attn.v_proj.weight, "kv_heads", "head_size", "embed")[i])
        if c.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D) + alibi[None].astype(np.float32)
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + jnp.einsum("bqhd,ehd->bqe", attn, arr(b.attn.o_proj.weight, "embed", "heads", "head_size")[i])
        h = layer_norm_no_bias(x, arr(b.norm_2.weight, "embed")[i], c.layer_norm_epsilon)
        up = jax.nn.gelu(h @ arr(b.ffn.up.weight, "embed", "mlp")[i], approximate=False)
        x = x + up @ arr(b.ffn.down.weight, "mlp", "embed")[i]
    x = layer_norm_no_bias(x, arr(model.norm_f.weight, "embed"), c.layer_norm_epsilon)
    return np.asarray(x @ wte.T)


def tiny(**overrides) -> lm.MptConfig:
    return lm.MptConfig(**{"seq_len": 16, "hidden_dim": 32, "num_layers": 2, "num_heads": 4, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [{}, {"clip_qkv": 0.05, "alibi_bias_max": 4.0}, {"num_heads": 6, "hidden_dim": 48, "intermediate_dim": 40}],
    ids=["plain", "clipped", "six-heads"],  # six: not a power of two, so slopes interleave,
)
def test_mpt_matches_plain_jax_reference(overrides, ids_of):
    model = tiny(**overrides).build(VOCAB, key=jax.random.key(0))
    ids = ids_of(6)
    logits = model(ids)
    with jax.numpy_rank_promotion("allow"):
        expected = reference_mpt(model, np.asarray(ids.array))
    np.testing.assert_allclose(np.asarray(logits.array), expected, atol=2e-5, rtol=1e-5)


def test_mpt_has_no_biases_and_a_tied_head():
    model = tiny().build(VOCAB, key=jax.random.key(0))
    b = model.blocks.stacked
    assert b.norm_1.bias is None and b.attn.q_proj.bias is None and b.ffn.up.bias is None
    assert model.norm_f.bias is None
    assert model.unembedding() is model.wte.weight
    assert model.config.Mlp.size == 4 * 32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"clip_qkv": 0.0}, "clip_qkv must be positive"),
        ({"num_heads": 5}, "num_heads=5 does not divide hidden_dim=32"),
        ({"alibi_bias_max": -1.0}, "alibi_bias_max must be positive"),
    ],
)
def test_mpt_bad_configs_fail_clearly(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)
