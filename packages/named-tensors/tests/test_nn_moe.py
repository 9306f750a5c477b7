"""Mixture of experts: routing, dropless dispatch and the auxiliary losses against a dense jax.numpy reference,
and expert parallelism (experts split over a mesh axis, tokens sent to them by all-to-all) against one device."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, nn

Embed, Experts, Mlp = Axis("embed", 10), Axis("experts", 8), Axis("mlp", 6)
K = 3


def _moe(seed=0):
    return nn.MixtureOfExperts.init(Embed, Experts, Mlp, K, key=jax.random.key(seed), init_scale=0.4, z_loss=True)


def _x(batch=4, length=7, seed=1):
    return nt.named(
        jax.random.normal(jax.random.key(seed), (batch, length, Embed.size)), ("batch", "position", "embed")
    )


def dense_reference(moe, x, normalize=True):
    """Every expert on every token (the dense definition), combined with Mixtral's renormalised top-k weights
    (or, with normalize=False, the top-k probabilities as they are)."""
    logits = jnp.einsum("bte,xe->btx", x, moe.router.weight.array)
    probs = jax.nn.softmax(logits, axis=-1)
    top, ids = jax.lax.top_k(probs, K)
    weights = top / top.sum(-1, keepdims=True) if normalize else top
    gate, up, down = moe.experts.gate.array, moe.experts.up.array, moe.experts.down.array  # (x, m, e), (x, e, m)
    hidden = jax.nn.silu(jnp.einsum("bte,xme->btxm", x, gate)) * jnp.einsum("bte,xme->btxm", x, up)
    every = jnp.einsum("btxm,xem->btxe", hidden, down)
    chosen = jnp.take_along_axis(every, ids[..., None], axis=2)
    out = jnp.sum(chosen * weights[..., None], axis=2)
    counts = jax.nn.one_hot(ids, Experts.size).sum(2)  # (b, t, x): how often each token chose each expert
    balance = Experts.size * jnp.sum(counts.mean((0, 1)) * probs.mean((0, 1)))
    z = jnp.mean(jax.scipy.special.logsumexp(logits, axis=-1) ** 2)
    return out, balance, z


def test_dispatch_and_auxiliary_losses_equal_the_dense_definition():
    moe, x = _moe(), _x()
    out, aux = jax.jit(lambda m, x: m(x))(moe, x)
    expected, balance, z = dense_reference(moe, x.array)
    assert out.axis_names == x.axis_names
    np.testing.assert_allclose(np.asarray(out.array), np.asarray(expected), atol=1e-5)
    np.testing.assert_allclose(aux["router_aux_loss"], balance, rtol=1e-5)
    np.testing.assert_allclose(aux["router_z_loss"], z, rtol=1e-5)
    weights, ids = nn.top_k_routing(moe.router(x), Experts, K)
    assert weights.axis_names == ("batch", "position", "top_experts") and ids.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(weights.array.sum(-1)), 1.0, rtol=1e-6)


def test_unnormalised_top_k_weights_are_the_chosen_probabilities():
    moe = nn.MixtureOfExperts.init(
        Embed, Experts, Mlp, K, key=jax.random.key(0), init_scale=0.4, normalize_weights=False
    )
    x = _x()
    out, aux = jax.jit(lambda m, x: m(x))(moe, x)
    expected, balance, _ = dense_reference(moe, x.array, normalize=False)
    np.testing.assert_allclose(np.asarray(out.array), np.asarray(expected), atol=1e-5)
    np.testing.assert_allclose(aux["router_aux_loss"], balance, rtol=1e-5)
    weights, _ = nn.top_k_routing(moe.router(x), Experts, K, normalize=False)
    assert float(weights.array.sum(-1).max()) < 1.0  # 3 of 8 probabilities: less than all of the mass


def test_experts_split_over_the_mesh_axis_that_also_splits_the_tokens_give_the_same_gradients():
    moe, x = _moe(2), _x(seed=3)

    def loss(m, x):
        out, aux = m(x)
        return nt.mean(out * out).array + aux["router_aux_loss"]

    grad = jax.jit(jax.value_and_grad(loss))
    value, grads = grad(moe, x)
    mesh = nt.make_mesh({"data": 4, "model": 2})
    # Batch and experts on the same mesh axis: each device sends its tokens to the devices of their experts,
    # runs its 2 experts on what arrives, and gets back its own tokens' sum over every device's experts.
    mapping = {"batch": "data", "experts": "data"}
    with nt.axis_mapping(mapping, mesh=mesh):
        sharded_value, sharded_grads = grad(nt.shard_tree(moe), nt.shard_tree(x))
    np.testing.assert_allclose(sharded_value, value, atol=1e-6)
    for g, ref in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-6)


def test_gpt_oss_experts_with_biases_and_clamped_swiglu_equal_the_dense_definition_and_split_over_devices():
    # gpt-oss: a router with a bias, softmax over the k largest logits (the renormalised top-k probabilities),
    # experts with biases and (clip(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l).
    moe = nn.MixtureOfExperts.init(
        Embed, Experts, Mlp, K, key=jax.random.key(4), init_scale=0.6, router_bias=True, expert_bias=True,
        swiglu_limit=0.7, swiglu_alpha=1.702,
    )  # fmt: skip
    moe = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(5), a.shape) if a.ndim < 3 else a, moe)
    x = _x(seed=6)
    out, _ = jax.jit(lambda m, x: m(x))(moe, x)
    logits = jnp.einsum("bte,xe->btx", x.array, moe.router.weight.array) + moe.router.bias.array[None, None]
    top, ids = jax.lax.top_k(logits, K)
    weights = jax.nn.softmax(top, axis=-1)
    e = moe.experts
    gate = jnp.einsum("bte,xme->btxm", x.array, e.gate.array) + e.gate_bias.array[None, None]
    up = jnp.einsum("bte,xme->btxm", x.array, e.up.array) + e.up_bias.array[None, None]
    gate, up = jnp.minimum(gate, 0.7), jnp.clip(up, -0.7, 0.7)
    hidden = gate * jax.nn.sigmoid(1.702 * gate) * (up + 1)
    every = jnp.einsum("btxm,xem->btxe", hidden, e.down.array) + e.down_bias.array[None, None]
    expected = jnp.sum(jnp.take_along_axis(every, ids[..., None], axis=2) * weights[..., None], axis=2)
    np.testing.assert_allclose(np.asarray(out.array), np.asarray(expected), atol=1e-5)
    assert float(jnp.abs(gate).max()) > 0.69  # the clamp was reached

    def loss(m, x):
        out, aux = m(x)
        return nt.mean(out * out).array + aux["router_aux_loss"]

    grad = jax.jit(jax.value_and_grad(loss))
    value, grads = grad(moe, x)
    mesh = nt.make_mesh({"data": 4, "model": 2})
    mapping = {"batch": "data", "experts": "model"}
    with nt.axis_mapping(mapping, mesh=mesh):
        sharded_value, sharded_grads = grad(nt.shard_tree(moe), nt.shard_tree(x))
    np.testing.assert_allclose(sharded_value, value, atol=1e-6)
    for g, ref in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), atol=1e-5)


def test_mixture_settings_are_checked():
    with pytest.raises(ValueError, match="num_experts_per_token=9 must be between 1 and the number of experts 8"):
        nn.MixtureOfExperts.init(Embed, Experts, Mlp, 9, key=jax.random.key(0))
    moe = nn.MixtureOfExperts.init(Embed, Axis("experts", 6), Mlp, 2, key=jax.random.key(0))
    mesh = nt.make_mesh({"data": 4, "model": 2})
    with nt.axis_mapping({"experts": "data"}, mesh=mesh), pytest.raises(ValueError, match="splits 6 experts"):
        jax.eval_shape(moe, _x())


def test_expert_parallel_all_to_all_dispatch_equals_one_device_with_a_crowded_device():
    # 4 devices, each holding 2 of the 8 experts and routing its own tokens (batch and experts on one mesh axis).
    # Every token has a large first embedding that experts 0 and 1 weigh heavily: device 0 receives far more rows
    # than the others, and the buffers (sized for the worst case: the layer drops nothing) still hold them all.
    moe = _moe(7)
    weight = moe.router.weight
    moe = eqx.tree_at(lambda m: m.router.weight, moe, nt.named(weight.array.at[0:2, 0].add(1.5), weight.axis_names))
    x = _x(batch=8, length=5, seed=8)
    x = nt.named(x.array.at[..., 0].add(2.0), x.axis_names)

    def loss(m, x):
        out, aux = m(x)
        return nt.sum(out * out).array + aux["router_aux_loss"] + aux["router_z_loss"], out.array

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (value, out), grads = grad(moe, x)
    expected, _, _ = dense_reference(moe, x.array)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5)
    _, ids = jax.lax.top_k(jnp.einsum("bte,xe->btx", x.array, weight.array.at[0:2, 0].add(1.5)), K)
    assert float(jnp.mean(ids // 2 == 0)) > 0.5  # over half of all choices land on device 0's experts
    mesh = nt.make_mesh({"expert": 4}, devices=jax.devices()[:4])
    with nt.axis_mapping({"batch": "expert", "experts": "expert"}, mesh=mesh):
        sharded_moe, sharded_x = nt.shard_tree(moe), nt.shard_tree(x)
        (sharded_value, sharded_out), sharded_grads = grad(sharded_moe, sharded_x)
        hlo = grad.lower(sharded_moe, sharded_x).compile().as_text()
    assert sharded_moe.experts.gate.array.sharding.spec[0] == "expert"  # each device holds its 2 experts
    # Tokens travel by all-to-all (there and back, forward and backward); no device gathers their hidden states.
    # The gathers left are the router's (experts, embed) weight, split over `expert` like the experts, and the
    # (batch, position, experts) router probabilities that GSPMD gathers for top_k on CPU, with or without
    # expert parallelism.
    assert hlo.count(" all-to-all(") >= 4
    assert set(re.findall(r"= (\S+) all-gather\(", hlo)) == {"f32[8,10]{1,0}", "f32[8,5,8]{2,1,0}"}
    np.testing.assert_allclose(np.asarray(sharded_out), np.asarray(out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sharded_value, value, rtol=1e-5)
    for g, ref in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-6)
