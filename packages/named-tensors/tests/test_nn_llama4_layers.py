"""Llama 4's layers against plain jax.numpy: the shared-expert MoE whose sigmoid weights scale the experts'
inputs, RoPE on interleaved (complex) pairs, and the chunked attention mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Embed, Experts, Mlp, SharedMlp = Axis("embed", 10), Axis("experts", 5), Axis("mlp", 6), Axis("mlp", 7)
K = 3


def _x(batch=2, length=7, seed=1):
    return nt.named(
        jax.random.normal(jax.random.key(seed), (batch, length, Embed.size)), ("batch", "position", "embed")
    )


def test_shared_expert_moe_equals_every_expert_on_its_scaled_input_plus_the_shared_mlp():
    moe = nn.SharedExpertMoE.init(Embed, Experts, Mlp, K, key=jax.random.key(0), SharedMlp=SharedMlp, init_scale=0.4)
    x = _x()
    out, aux = jax.jit(lambda m, x: m(x))(moe, x)

    # The dense definition (transformers' Llama4TextMoe): every expert sees sigmoid(logit) * x, where the logit
    # is -inf (a weight of zero) outside the token's k largest.
    xa = x.array
    logits = jnp.einsum("bte,xe->btx", xa, moe.router.weight.array)
    top, ids = jax.lax.top_k(logits, K)
    kept = jnp.full_like(logits, -jnp.inf).at[jnp.arange(2)[:, None, None], jnp.arange(7)[None, :, None], ids].set(top)
    scaled = xa[:, :, None, :] * jax.nn.sigmoid(kept)[..., None]  # (b, t, x, e)
    gate, up, down = moe.experts.gate.array, moe.experts.up.array, moe.experts.down.array
    hidden = jax.nn.silu(jnp.einsum("btxe,xme->btxm", scaled, gate)) * jnp.einsum("btxe,xme->btxm", scaled, up)
    routed = jnp.einsum("btxm,xem->bte", hidden, down)
    s = moe.shared
    shared = (jax.nn.silu(xa @ s.gate.weight.array.T) * (xa @ s.up.weight.array.T)) @ s.down.weight.array.T
    assert out.axis_names == x.axis_names and s.gate.weight.axis_size("mlp") == 7
    np.testing.assert_allclose(np.asarray(out.array), np.asarray(routed + shared), atol=1e-5)
    probs = jax.nn.softmax(logits, axis=-1)
    counts = jax.nn.one_hot(ids, Experts.size).sum(2)
    balance = Experts.size * jnp.sum(counts.mean((0, 1)) * probs.mean((0, 1)))
    np.testing.assert_allclose(aux["router_aux_loss"], balance, rtol=1e-5)

    weights, chosen = nn.sigmoid_top_k_routing(moe.router(x), Experts, K)
    assert weights.axis_names == ("batch", "position", "top_experts") and chosen.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(weights.array), np.asarray(jax.nn.sigmoid(top)), rtol=1e-6)
    with pytest.raises(ValueError, match="num_experts_per_token=6 must be between 1 and the number of experts 5"):
        nn.SharedExpertMoE.init(Embed, Experts, Mlp, 6, key=jax.random.key(0))


def test_interleaved_rope_rotates_complex_pairs():
    HeadSize, Pos = Axis("head_size", 8), Axis("position", 6)
    x = nt.named(jax.random.normal(jax.random.key(2), (Pos.size, 3, HeadSize.size)), (Pos, "heads", HeadSize))
    positions = nt.arange(Pos, dtype=jnp.int32)
    scaling = nn.Llama3RopeScaling(4.0, 1.0, 4.0, 4)
    rope = nn.RotaryEmbeddings(8, 50.0, scaling, interleaved=True)
    out = rope(x, positions)

    inv_freq = rope.inverse_frequencies()
    angles = np.arange(Pos.size)[:, None] * np.asarray(inv_freq)[None, :]  # (t, 4)
    pairs = np.asarray(x.array).reshape(Pos.size, 3, 4, 2)
    z = (pairs[..., 0] + 1j * pairs[..., 1]) * np.exp(1j * angles)[:, None, :]
    expected = np.stack([z.real, z.imag], axis=-1).reshape(Pos.size, 3, 8)
    assert out.axis_names == x.axis_names
    np.testing.assert_allclose(np.asarray(out.array), expected, atol=1e-5)
    # The halves layout is another rotation of the same features.
    assert not np.allclose(np.asarray(nn.RotaryEmbeddings(8, 50.0, scaling)(x, positions).array), expected, atol=1e-3)


def test_chunked_mask_keeps_each_query_to_its_chunk():
    q = nt.named(jnp.arange(3, 10, dtype=jnp.int32), ("position",))
    k = nt.named(jnp.arange(10, dtype=jnp.int32), ("key_position",))
    mask = nn.chunked_mask(q, k, 4)
    expected = (np.arange(3, 10)[:, None] // 4) == (np.arange(10)[None, :] // 4)
    assert mask is not None and mask.axis_names == ("position", "key_position")
    np.testing.assert_array_equal(np.asarray(mask.array), expected)
    assert nn.chunked_mask(q, k, None) is None
    with pytest.raises(ValueError, match="positive chunk_size"):
        nn.chunked_mask(q, k, 0)
