"""Linear, Embedding, LayerNorm, RMSNorm, Dropout, MLP and GatedMLP against plain jnp references."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Batch, Pos, Embed = Axis("batch", 2), Axis("position", 3), Axis("embed", 4)
Heads, HeadSize, Mlp, Vocab = Axis("heads", 2), Axis("head_size", 3), Axis("mlp", 5), Axis("vocab", 7)


def _x(*axes, seed=0, dtype=jnp.float32):
    shape = tuple(a.size for a in axes)
    return nt.named(jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype), axes)


def test_linear_contracts_several_in_axes_into_several_out_axes():
    layer = nn.Linear.init((Heads, HeadSize), (Embed, Mlp), key=jax.random.PRNGKey(0))
    layer = eqx.tree_at(lambda m: m.bias, layer, _x(Embed, Mlp, seed=5))
    x = _x(Batch, Pos, Heads, HeadSize)
    y = layer(x)
    assert y.axis_names == ("batch", "position", "embed", "mlp")
    assert layer.weight.axis_names == ("embed", "mlp", "heads", "head_size")
    w, b = np.asarray(layer.weight.array), np.asarray(layer.bias.array)
    expected = np.einsum("bphd,emhd->bpem", x.array, w) + b
    np.testing.assert_allclose(y.array, expected, rtol=1e-5, atol=1e-6)


def test_linear_init_scale_and_no_bias():
    In, Out = Axis("embed", 400), Axis("mlp", 300)
    layer = nn.Linear.init(In, Out, key=jax.random.PRNGKey(1), use_bias=False, init_scale=2.0)
    assert layer.bias is None
    assert float(jnp.std(layer.weight.array)) == pytest.approx(2.0 / np.sqrt(400), rel=0.02)
    fixed = nn.Linear.init(In, Out, key=jax.random.PRNGKey(1), init_scale=0.02, scale_by_fan_in=False)
    assert float(jnp.std(fixed.weight.array)) == pytest.approx(0.02, rel=0.02)
    half = nn.Linear.init(Embed, Mlp, key=jax.random.PRNGKey(1), dtype=jnp.bfloat16)
    assert half.weight.dtype == jnp.bfloat16 and half.bias.dtype == jnp.bfloat16


def test_linear_errors():
    with pytest.raises(ValueError, match="share the name"):
        nn.Linear.init(Embed, Embed, key=jax.random.PRNGKey(0))
    layer = nn.Linear.init(Embed, Mlp, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="needs an input with axis 'embed'"):
        layer(_x(Batch, Mlp))
    with pytest.raises(ValueError, match="already has output axis"):
        layer(_x(Embed, Mlp))
    with pytest.raises(ValueError, match="size"):
        layer(_x(Batch, Axis("embed", 9)))
    with pytest.raises(TypeError, match="dtype"):
        layer(_x(Batch, Embed, dtype=jnp.bfloat16))


def test_embedding_embed_unembed_and_bad_ids():
    emb = nn.Embedding.init(Vocab, Embed, key=jax.random.PRNGKey(0), init_scale=0.5)
    assert emb.weight.axis_names == ("vocab", "embed")
    ids = nt.named(jnp.array([[0, 6, 3], [2, 2, 5]]), (Batch, Pos))
    e = emb.embed(ids)
    assert e.axis_names == ("batch", "position", "embed")
    np.testing.assert_array_equal(e.array, emb.weight.array[ids.array])
    logits = emb.unembed(e)
    assert logits.axis_names == ("batch", "position", "vocab")
    np.testing.assert_allclose(logits.array, e.array @ emb.weight.array.T, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        emb.embed(nt.named(jnp.array([0, 7]), ("position",)))
    with pytest.raises(ValueError, match="outside"):
        emb.embed(nt.named(jnp.array([-1, 2]), ("position",)))
    with pytest.raises(TypeError, match="integer"):
        emb.embed(nt.named(jnp.array([0.0, 1.0]), ("position",)))
    # Under jit a bad id cannot raise: it must read as NaN rather than another token's row.
    bad = jax.jit(lambda m, i: m.embed(i))(emb, nt.named(jnp.array([1, 7, -1]), ("position",)))
    assert np.isfinite(bad.array[0]).all() and np.isnan(bad.array[1:]).all()


def _layernorm_ref(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def test_layernorm_matches_reference_with_and_without_params():
    x = _x(Batch, Pos, Embed)
    ln = nn.LayerNorm.init(Embed, eps=1e-3)
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), ln, (_x(Embed, seed=1), _x(Embed, seed=2)))
    np.testing.assert_allclose(
        ln(x).array,
        _layernorm_ref(np.asarray(x.array), np.asarray(ln.weight.array), np.asarray(ln.bias.array), 1e-3),
        rtol=1e-5,
        atol=1e-5,
    )
    bare = nn.LayerNorm.init(Embed, use_weight=False, use_bias=False)
    assert bare.weight is None and bare.bias is None
    np.testing.assert_allclose(bare(x).array, _layernorm_ref(np.asarray(x.array), 1.0, 0.0, 1e-5), atol=1e-5)
    # Over a non-last axis: the result is normalised along position.
    by_pos = nn.LayerNorm.init(Pos, use_bias=False)(x)
    ref = _layernorm_ref(np.moveaxis(np.asarray(x.array), 1, -1), 1.0, 0.0, 1e-5)
    np.testing.assert_allclose(by_pos.array, np.moveaxis(ref, -1, 1), atol=1e-5)


def test_rmsnorm_matches_reference_and_upcasts_bf16():
    x = _x(Batch, Pos, Embed)
    rms = eqx.tree_at(lambda m: m.weight, nn.RMSNorm.init(Embed, eps=1e-6), _x(Embed, seed=3))
    xa = np.asarray(x.array)
    ref = xa / np.sqrt((xa**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(rms.weight.array)
    np.testing.assert_allclose(rms(x).array, ref, rtol=1e-5, atol=1e-6)
    xb = x.astype(jnp.bfloat16)
    up = rms(xb)
    assert up.dtype == jnp.bfloat16
    xf = np.asarray(xb.array.astype(jnp.float32))
    ref_b = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(rms.weight.array)
    np.testing.assert_allclose(up.array.astype(jnp.float32), ref_b.astype(jnp.bfloat16).astype(np.float32))
    no_up = eqx.tree_at(lambda m: m.weight, nn.RMSNorm.init(Embed, upcast=False), rms.weight)(xb)
    assert no_up.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="axis 'mlp'"):
        nn.RMSNorm.init(Mlp)(x)
    with pytest.raises(TypeError, match="floating"):
        nn.RMSNorm.init(Embed)(nt.named(jnp.ones((4,), jnp.int32), (Embed,)))


def test_dropout_training_inference_and_errors():
    x = nt.named(jnp.ones((100, 50)), ("batch", "embed"))
    drop = nn.Dropout(0.3)
    y = drop(x, key=jax.random.PRNGKey(0))
    kept = y.array != 0
    assert 0.6 < float(kept.mean()) < 0.8
    np.testing.assert_allclose(y.array[kept], 1 / 0.7, rtol=1e-6)
    assert drop(x, inference=True) is x
    assert nn.Dropout(0.3, inference=True)(x) is x
    assert nn.Dropout(0.0)(x) is x
    assert float(nn.Dropout(1.0)(x, key=jax.random.PRNGKey(0)).array.max()) == 0.0
    with pytest.raises(ValueError, match="needs a PRNG key"):
        drop(x)
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        nn.Dropout(1.5)


def test_mlp_and_gated_mlp_match_reference():
    x = _x(Batch, Pos, Embed)
    mlp = nn.MLP.init(Embed, Mlp, Embed.alias("embed_out"), key=jax.random.PRNGKey(0), activation="gelu")
    wu, bu, wd, bd = (
        np.asarray(a) for a in (mlp.up.weight.array, mlp.up.bias.array, mlp.down.weight.array, mlp.down.bias.array)
    )
    hidden = np.asarray(jax.nn.gelu(np.einsum("bpe,me->bpm", x.array, wu) + bu, approximate=False))
    np.testing.assert_allclose(mlp(x).array, np.einsum("bpm,om->bpo", hidden, wd) + bd, rtol=1e-5, atol=1e-5)

    gated = nn.GatedMLP.init(Embed, Mlp, Embed.alias("embed_out"), key=jax.random.PRNGKey(1))
    assert gated.gate.bias is None
    g = np.einsum("bpe,me->bpm", x.array, gated.gate.weight.array)
    u = np.einsum("bpe,me->bpm", x.array, gated.up.weight.array)
    ref = np.einsum("bpm,om->bpo", g / (1 + np.exp(-g)) * u, gated.down.weight.array)
    np.testing.assert_allclose(gated(x).array, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="Unknown activation 'geluu'"):
        nn.MLP.init(Embed, Mlp, Embed.alias("o"), key=jax.random.PRNGKey(0), activation="geluu")


def test_activation_names_follow_hugging_face():
    v = jnp.linspace(-3, 3, 7)
    x = nt.named(v, ("embed",))
    np.testing.assert_allclose(nn.activation_fn("gelu")(x).array, jax.nn.gelu(v, approximate=False))
    np.testing.assert_allclose(nn.activation_fn("gelu_new")(x).array, jax.nn.gelu(v, approximate=True))
    np.testing.assert_allclose(nn.activation_fn("quick_gelu")(x).array, v / (1 + jnp.exp(-1.702 * v)), rtol=1e-6)
    np.testing.assert_allclose(nn.activation_fn("silu")(x).array, v / (1 + jnp.exp(-v)), rtol=1e-6)


def test_layers_work_under_jit_and_grad():
    mlp = nn.MLP.init(Embed, Mlp, Embed.alias("out"), key=jax.random.PRNGKey(0))
    x = _x(Batch, Pos, Embed)

    @jax.jit
    def loss(m, x):
        return nt.sum(m(x) ** 2).scalar()

    grads = jax.grad(loss)(mlp, x)
    assert grads.up.weight.axis_names == mlp.up.weight.axis_names
    assert float(jnp.abs(grads.up.weight.array).sum()) > 0
