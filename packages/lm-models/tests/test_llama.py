"""Llama against a plain jax.numpy forward pass (RoPE, GQA/MQA, tied and untied heads), plus config errors."""

import math

import equinox as eqx
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


def inverse_frequencies(rope: lm.RopeConfig, head_size: int) -> np.ndarray:
    """RoPE frequencies per the published formulas (plain, linear interpolation, Llama 3.1 band scaling)."""
    inv = 1.0 / rope.theta ** (np.arange(0, head_size, 2, dtype=np.float64) / head_size)
    if rope.type == "linear":
        return inv / rope.factor
    if rope.type == "llama3":
        wavelength = 2 * np.pi / inv
        low_wl = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wl = rope.original_max_position_embeddings / rope.high_freq_factor
        out = []
        for f, wl in zip(inv, wavelength, strict=True):
            if wl < high_wl:
                out.append(f)
            elif wl > low_wl:
                out.append(f / rope.factor)
            else:
                s = (rope.original_max_position_embeddings / wl - rope.low_freq_factor) / (
                    rope.high_freq_factor - rope.low_freq_factor
                )
                out.append((1 - s) * f / rope.factor + s * f)
        return np.array(out)
    return inv


def rotate(x, inv_freq):
    """x (batch, seq, heads, d): rotate-half RoPE at positions 0..seq-1."""
    seq, d = x.shape[1], x.shape[-1]
    angles = np.arange(seq)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[None, :, None, :].astype(np.float32)
    sin = np.sin(np.concatenate([angles, angles], -1))[None, :, None, :].astype(np.float32)
    half = jnp.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def rms_norm(x, w, eps):
    return x / jnp.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def reference_llama(model: lm.DecoderLMHeadModel, ids: np.ndarray) -> np.ndarray:
    """Llama forward pass written with jax.numpy on raw arrays."""
    c = model.config
    H, KV, D = c.num_heads, c.num_kv_heads, c.hidden_dim // c.num_heads
    inv = inverse_frequencies(c.rope, D)
    seq = ids.shape[1]
    x = arr(model.embed_tokens.weight, "vocab", "embed")[ids]
    b = model.blocks.stacked
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(c.num_layers):
        h = rms_norm(x, arr(b.pre_attn_norm.weight, "embed")[i], c.layer_norm_epsilon)
        q = jnp.einsum("bse,hde->bshd", h, arr(b.self_attn.q_proj.weight, "heads", "head_size", "embed")[i])
        k = jnp.einsum("bse,hde->bshd", h, arr(b.self_attn.k_proj.weight, "kv_heads", "head_size", "embed")[i])
        v = jnp.einsum("bse,hde->bshd", h, arr(b.self_attn.v_proj.weight, "kv_heads", "head_size", "embed")[i])
        if c.use_bias:
            q = q + arr(b.self_attn.q_proj.bias, "heads", "head_size")[i]
            k = k + arr(b.self_attn.k_proj.bias, "kv_heads", "head_size")[i]
            v = v + arr(b.self_attn.v_proj.bias, "kv_heads", "head_size")[i]
        q, k = rotate(q, inv), rotate(k, inv)
        # Query head h reads key/value head h // (H / KV), as Hugging Face's repeat_kv arranges them.
        k = jnp.repeat(k, H // KV, axis=2)
        v = jnp.repeat(v, H // KV, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + jnp.einsum("bqhd,ehd->bqe", attn, arr(b.self_attn.o_proj.weight, "embed", "heads", "head_size")[i])
        if c.use_bias:
            x = x + arr(b.self_attn.o_proj.bias, "embed")[i]
        h = rms_norm(x, arr(b.pre_mlp_norm.weight, "embed")[i], c.layer_norm_epsilon)
        gate = h @ arr(b.mlp.gate.weight, "embed", "mlp")[i]
        up = h @ arr(b.mlp.up.weight, "embed", "mlp")[i]
        if c.use_bias:
            gate, up = gate + arr(b.mlp.gate.bias, "mlp")[i], up + arr(b.mlp.up.bias, "mlp")[i]
        x = x + (jax.nn.silu(gate) * up) @ arr(b.mlp.down.weight, "mlp", "embed")[i]
        if c.use_bias:
            x = x + arr(b.mlp.down.bias, "embed")[i]
    x = rms_norm(x, arr(model.norm.weight, "embed"), c.layer_norm_epsilon)
    return np.asarray(x @ arr(model.unembedding(), "vocab", "embed").T)


def tiny(**overrides) -> lm.LlamaConfig:
    base = {"seq_len": 16, "hidden_dim": 32, "intermediate_dim": 48, "num_layers": 2, "num_heads": 4}
    return lm.LlamaConfig(**{**base, "num_kv_heads": 4, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_kv_heads": 2, "tie_word_embeddings": True, "use_bias": True},
        {"num_kv_heads": 1, "rope": lm.RopeConfig(type="linear", factor=2.0, theta=500.0)},
        {
            "num_kv_heads": 2,
            "rope": lm.RopeConfig(type="llama3", factor=8.0, original_max_position_embeddings=64, theta=5e5),
        },
    ],
    ids=["mha", "gqa-tied-biased", "mqa-linear-rope", "gqa-llama3-rope"],
)
def test_llama_matches_plain_jax_reference(overrides, ids_of, random_biases):
    model = tiny(**overrides).build(VOCAB, key=jax.random.key(0))
    assert (model.lm_head is None) == model.config.tie_word_embeddings
    model, biases = random_biases(model, jax.random.key(9))
    assert biases == (7 if model.config.use_bias else 0)  # q, k, v, o, gate, up, down
    ids = ids_of(5)
    logits = model(ids)
    assert logits.axis_names == ("batch", "position", "vocab")
    with jax.numpy_rank_promotion("allow"):
        expected = reference_llama(model, np.asarray(ids.array))
    np.testing.assert_allclose(np.asarray(logits.array), expected, atol=2e-5, rtol=1e-5)


def test_llama3_scaling_changes_the_model():
    rope = lm.RopeConfig(type="llama3", factor=8.0, original_max_position_embeddings=64, theta=5e5)
    assert not np.allclose(inverse_frequencies(rope, 8), inverse_frequencies(lm.RopeConfig(theta=5e5), 8))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_kv_heads": 3}, "num_kv_heads=3 does not divide num_heads=4"),
        ({"num_heads": 3}, "num_heads=3 does not divide hidden_dim=32"),
        ({"hidden_dim": 12, "num_heads": 4, "num_kv_heads": 4}, "must be even for rotary"),
        ({"intermediate_dim": -1}, "intermediate_dim must be a positive integer"),
    ],
)
def test_llama_bad_configs_fail_clearly(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_rope_config_rejects_unknown_types():
    with pytest.raises(ValueError, match=r"rope\.type='longrope' is not supported"):
        lm.RopeConfig(type="longrope")
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        lm.RopeConfig(type="llama3", low_freq_factor=4.0, high_freq_factor=1.0)


def test_an_attention_mask_hides_left_padding(ids_of):
    model = tiny(num_kv_heads=2).build(VOCAB, key=jax.random.key(1))
    ids = ids_of(12, batch=2)
    pad = 3
    not_padding = nt.named(jnp.arange(16) >= pad, ("key_position",))
    masked = jax.jit(lambda m, x, mask: m(x, mask).array)(model, ids, not_padding)
    # RoPE depends only on the distance between positions, so once the padding is hidden the later tokens
    # see exactly what they would see without it.
    alone = jax.jit(lambda m, x: m(x).array)(model, ids["position", pad:])
    np.testing.assert_allclose(masked[:, pad:], alone, atol=1e-5, rtol=1e-5)


def test_llama_is_the_shared_decoder_with_a_spec_of_its_own():
    config = tiny(num_kv_heads=2, use_bias=True, use_layer_norm_weight=False)
    assert config.decoder_spec() == lm.DecoderSpec(qkv_bias=True, out_bias=True, mlp_bias=True, norm_weight=False)
    model = config.build(VOCAB, key=jax.random.key(3))
    assert type(model) is lm.DecoderLMHeadModel
    blocks = model.blocks.stacked
    assert blocks.pre_attn_norm.weight is None and blocks.pre_mlp_norm.weight is None and model.norm.weight is None
    assert blocks.post_attn_norm is None and blocks.post_mlp_norm is None
    # Without a learned scale each norm is x / rms(x): the reference with a weight of ones.
    ones = nt.named(jnp.ones((2, 32)), ("layers", "embed"))
    weighted = with_unit_norm_weights(model, ones)
    ids = np.asarray(jax.random.randint(jax.random.key(4), (2, 7), 0, VOCAB.size))
    with jax.numpy_rank_promotion("allow"):
        expected = reference_llama(weighted, ids)
    logits = model(nt.named(jnp.asarray(ids), ("batch", "position")))
    np.testing.assert_allclose(np.asarray(logits.array), expected, atol=2e-5, rtol=1e-5)


def with_unit_norm_weights(model, ones):
    """The model with weights of one in its block norms and its final norm (for the plain reference)."""
    model = eqx.tree_at(lambda m: m.blocks.stacked.pre_attn_norm.weight, model, ones, is_leaf=lambda x: x is None)
    model = eqx.tree_at(lambda m: m.blocks.stacked.pre_mlp_norm.weight, model, ones, is_leaf=lambda x: x is None)
    return eqx.tree_at(lambda m: m.norm.weight, model, nt.named(jnp.ones(32), ("embed",)), is_leaf=lambda x: x is None)


def test_llama_head_dim_may_only_repeat_hidden_dim_over_num_heads():
    assert tiny(head_dim=8) == tiny()
    with pytest.raises(ValueError, match=r"head_dim=16 is not hidden_dim / num_heads = 32/4"):
        tiny(head_dim=16)
