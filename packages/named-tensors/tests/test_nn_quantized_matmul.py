"""Quantized Linear matmuls against quantize-then-matmul references written directly in jax.numpy."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors.nn import quantized_matmul as qm

Batch, Pos, Embed, Mlp = nt.Axis("batch", 3), nt.Axis("position", 5), nt.Axis("embed", 16), nt.Axis("mlp", 8)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _fp8_ref(a, dtype, amax):
    # Quantize with the per-tensor scale amax / max, back to f32, times the scale: the dequantized operand.
    top = E4M3_MAX if dtype == jnp.float8_e4m3fn else E5M2_MAX
    scale = amax / top
    return jnp.clip(a / scale, -top, top).astype(dtype).astype(jnp.float32) * scale


@pytest.fixture(scope="module")
def operands():
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = 3.0 * jax.random.normal(kx, (3, 5, 16), jnp.float32)
    w = 0.2 * jax.random.normal(kw, (8, 16), jnp.float32)
    cot = 1e-3 * jax.random.normal(kc, (3, 5, 8), jnp.float32)
    return x, w, cot


def _linear(w, quant):
    return nt.nn.Linear(nt.NamedArray(w, (Mlp, Embed)), None, (Embed,), (Mlp,), quant)


def _grads(linear, x, cot):
    def loss(layer, xs):
        y = layer(nt.NamedArray(xs, (Batch, Pos, Embed)))
        return jnp.sum(nt.permute(y, ("batch", "position", "mlp")).array * cot)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))(linear, x)


def _fp8_reference(x, w, cot, amax_x, amax_w, amax_g):
    xd, wd = _fp8_ref(x, jnp.float8_e4m3fn, amax_x), _fp8_ref(w, jnp.float8_e4m3fn, amax_w)
    gd = _fp8_ref(cot, jnp.float8_e5m2, amax_g)
    y = jnp.einsum("bpe,me->bpm", xd, wd, precision="highest")
    dx = jnp.einsum("bpm,me->bpe", gd, wd, precision="highest")
    dw = jnp.einsum("bpm,bpe->me", gd, xd, precision="highest")
    return y, dx, dw


def test_fp8_current_scaling_matches_quantize_then_matmul(operands):
    x, w, cot = operands
    layer = _linear(w, qm.Fp8Matmul())
    y = jax.jit(lambda m, a: m(nt.NamedArray(a, (Batch, Pos, Embed))))(layer, x)
    amax = [jnp.max(jnp.abs(t)) for t in (x, w, cot)]
    y_ref, dx_ref, dw_ref = _fp8_reference(x, w, cot, *amax)
    np.testing.assert_allclose(nt.permute(y, ("batch", "position", "mlp")).array, y_ref, rtol=1e-6, atol=1e-6)
    # The quantization is visible: fp8 differs from the f32 product by far more than the tolerance.
    assert float(jnp.max(jnp.abs(y_ref - jnp.einsum("bpe,me->bpm", x, w, precision="highest")))) > 1e-3
    g_layer, g_x = _grads(layer, x, cot)
    np.testing.assert_allclose(g_x, dx_ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g_layer.weight.array, dw_ref, rtol=1e-6, atol=1e-9)


def test_fp8_delayed_scaling_uses_the_history_max(operands):
    x, w, cot = operands
    History = nt.Axis(qm.AMAX_HISTORY, 4)
    # Larger than the current amaxes, so the scales (and the rounding) differ from current scaling.
    hx, hw, hg = (jnp.array([0.0, v, 0.5 * v, 0.0], jnp.float32) for v in (20.0, 2.0, 0.01))
    quant = qm.Fp8Matmul(*(nt.NamedArray(h, (History,)) for h in (hx, hw, hg)))
    layer = _linear(w, quant)
    y = layer(nt.NamedArray(x, (Batch, Pos, Embed)))
    y_ref, dx_ref, dw_ref = _fp8_reference(x, w, cot, 20.0, 2.0, 0.01)
    np.testing.assert_allclose(nt.permute(y, ("batch", "position", "mlp")).array, y_ref, rtol=1e-6, atol=1e-6)
    g_layer, g_x = _grads(layer, x, cot)
    np.testing.assert_allclose(g_x, dx_ref, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g_layer.weight.array, dw_ref, rtol=1e-6, atol=1e-9)
    # The histories' "gradients" are the amaxes this call saw; recording them rolls each history by one.
    seen = [float(jnp.max(jnp.abs(t))) for t in (x, w, cot)]
    for field, amax in zip(qm.HISTORY_FIELDS, seen, strict=True):
        np.testing.assert_allclose(getattr(g_layer.quant, field).array, np.full(4, amax), rtol=1e-6)
    recorded = qm.record_amax(quant, g_layer.quant)
    np.testing.assert_allclose(recorded.input_history.array, [seen[0], 0.0, 20.0, 10.0], rtol=1e-6)
    inf = jax.tree_util.tree_map(lambda h: jnp.full_like(h, jnp.inf), g_layer.quant)
    assert float(qm.record_amax(quant, inf).grad_history.array[0]) == 0.0  # an overflow is not recorded
    # An empty history (all zero) falls back to the current amax: the same numbers as current scaling.
    empty = qm.fp8_matmul(layer, "delayed", 4)
    assert empty.input_history.axis_names == (qm.AMAX_HISTORY,)
    y_empty = _linear(w, empty)(nt.NamedArray(x, (Batch, Pos, Embed)))
    y_current = _linear(w, qm.Fp8Matmul())(nt.NamedArray(x, (Batch, Pos, Embed)))
    np.testing.assert_array_equal(y_empty.array, y_current.array)


def test_int8_per_token_and_per_channel_scales(operands):
    x, w, cot = operands
    layer = _linear(w, qm.Int8Matmul())
    y = jax.jit(lambda m, a: m(nt.NamedArray(a, (Batch, Pos, Embed))))(layer, x)
    sx = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0  # one scale per token
    sw = jnp.max(jnp.abs(w), axis=-1, keepdims=True) / 127.0  # one scale per output channel
    xi = jnp.clip(jnp.round(x / sx), -127, 127).astype(jnp.int32)
    wi = jnp.clip(jnp.round(w / sw), -127, 127).astype(jnp.int32)
    acc = jnp.einsum("bpe,me->bpm", xi, wi)  # integers: exact
    y_ref = acc.astype(jnp.float32) * sx * sw.reshape(1, 1, -1)
    np.testing.assert_allclose(nt.permute(y, ("batch", "position", "mlp")).array, y_ref, rtol=1e-6, atol=0)
    g_layer, g_x = _grads(layer, x, cot)
    xd, wd = xi.astype(jnp.float32) * sx, wi.astype(jnp.float32) * sw
    np.testing.assert_allclose(g_x, jnp.einsum("bpm,me->bpe", cot, wd, precision="highest"), rtol=1e-6, atol=1e-9)
    dw_ref = jnp.einsum("bpm,bpe->me", cot, xd, precision="highest")
    np.testing.assert_allclose(g_layer.weight.array, dw_ref, rtol=1e-6, atol=1e-9)


def test_quantize_linears_targets_and_a_plain_linear_keeps_its_tree():
    class Block(eqx.Module):
        q_proj: nt.nn.Linear
        up_proj: nt.nn.Linear
        lm_head: nt.nn.Linear

    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    Out = nt.Axis("out", 4)
    block = Block(*(nt.nn.Linear.init(Embed, Out, key=k) for k in (k1, k2, k3)))
    plain_leaves = jax.tree_util.tree_leaves(block)
    assert len(plain_leaves) == 6  # weights and biases only: an unquantized Linear holds nothing more
    q = qm.quantize_linears(block, "fp8", ["q_proj", "up_proj"], history_length=8)
    assert isinstance(q.q_proj.quant, qm.Fp8Matmul) and isinstance(q.up_proj.quant, qm.Fp8Matmul)
    assert q.lm_head.quant is None
    assert qm.has_amax_histories(q) and not qm.has_amax_histories(block)
    plain = nt.nn.plain_linears(q)
    assert jax.tree_util.tree_structure(plain) == jax.tree_util.tree_structure(block)
    assert qm.quantization_targets(block, "up_.*") == ["up_proj"]
    current = qm.quantize_linears(block, "fp8", ["q_proj"], scaling="current")
    assert not qm.has_amax_histories(current)
    with pytest.raises(ValueError, match=r"\['o_proj'\] match no Linear layer.*lm_head"):
        qm.quantize_linears(block, "int8", ["o_proj"])
    with pytest.raises(ValueError, match="scaling must be one of"):
        qm.quantize_linears(block, "fp8", ["q_proj"], scaling="late")
