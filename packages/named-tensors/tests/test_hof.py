"""nt.vmap, nt.scan and nt.fold against jax.vmap and jax.lax.scan."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import named_tensors as nt
from named_tensors import Axis

SETTINGS = settings(max_examples=25, deadline=None)


def rand(names_sizes: dict[str, int], seed: int = 0) -> nt.NamedArray:
    rng = np.random.default_rng(seed)
    return nt.named(rng.normal(size=tuple(names_sizes.values())).astype(np.float32), tuple(names_sizes))


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# -- vmap ---------------------------------------------------------------------------------------------------


def test_vmap_maps_named_axis_and_puts_it_first():
    x = rand({"embed": 3, "batch": 4}, 1)  # batch is not leading: the mapped axis may sit anywhere
    w = rand({"embed": 3, "mlp": 5}, 2)  # no batch axis: broadcast to every call

    def project(x1, w1):
        assert x1.axis_names == ("embed",)
        assert w1.axis_names == ("embed", "mlp")
        return nt.dot(x1, w1, axis="embed")

    y = nt.vmap(project, "batch")(x, w)
    assert y.axes == (Axis("batch", 4), Axis("mlp", 5))
    expected = jax.vmap(lambda xi: xi @ w.array, in_axes=1)(x.array)
    close(y.array, expected)


@SETTINGS
@given(st.permutations(["a", "b", "c"]), st.sampled_from(["a", "b", "c"]))
def test_vmap_matches_jax_vmap_for_any_layout(order, mapped):
    sizes = {"a": 2, "b": 3, "c": 4}
    x = rand({n: sizes[n] for n in order}, 3)

    def f(x1):
        return nt.softmax(x1, [n for n in x1.axis_names][-1]) * 2.0

    y = nt.vmap(f, mapped)(x)
    rest = [n for n in order if n != mapped]
    assert y.axis_names == (mapped, *rest)

    def reference(raw_slice):
        return jax.nn.softmax(raw_slice, axis=-1) * 2.0

    close(y.array, jax.vmap(reference, in_axes=order.index(mapped))(x.array))


def test_vmap_pytrees_kwargs_plain_arrays_and_static_leaves():
    params = {"w": rand({"embed": 3, "mlp": 2}, 1), "scale": jnp.float32(2.0)}
    x = rand({"batch": 4, "embed": 3}, 2)
    offset = jnp.arange(2.0)  # plain array: not mapped, even though its length could match

    def f(params, x1, *, offset, activation):
        h = activation(nt.dot(x1, params["w"], axis="embed")) * params["scale"]
        return {"h": h, "raw": h.array + offset, "name": "layer", "count": 3}

    out = nt.vmap(f, "batch")(params, x, offset=offset, activation=nt.tanh)
    assert out["h"].axes == (Axis("batch", 4), Axis("mlp", 2))
    assert out["name"] == "layer"
    expected = jnp.tanh(x.array @ params["w"].array) * 2.0
    close(out["h"].array, expected)
    close(out["raw"], expected + offset[None, :])  # plain outputs are stacked along the leading dimension
    assert out["raw"].shape == (4, 2)
    close(out["count"], jnp.full((4,), 3))


def test_vmap_with_axis_object_and_no_mapped_argument_repeats_the_call():
    Layers = Axis("layers", 3)
    w = rand({"embed": 2}, 1)
    y = nt.vmap(lambda w1: w1 * 2.0, Layers)(w)
    assert y.axes == (Layers, Axis("embed", 2))
    close(y.array, jnp.broadcast_to(w.array * 2.0, (3, 2)))


class _Layer(eqx.Module):
    weight: nt.NamedArray
    bias: nt.NamedArray
    activation: str = eqx.field(static=True)

    def __call__(self, x):
        return nt.tanh(nt.dot(x, self.weight, axis="embed").rename({"out": "embed"}) + self.bias)


def _make_layer(key):
    Embed, Out = Axis("embed", 3), Axis("out", 3)
    wkey, bkey = jax.random.split(key)
    weight = nt.named(jax.random.normal(wkey, (3, 3)), (Embed, Out))
    bias = nt.named(jax.random.normal(bkey, (3,)), (Embed,))
    return _Layer(weight, bias, "tanh")


def test_vmap_module_init_over_keys_gives_per_layer_parameters():
    Layers = Axis("layers", 4)
    keys = jax.random.split(jax.random.key(0), Layers.size)
    stacked = nt.vmap(_make_layer, Layers, map_plain=[0])(keys)
    assert isinstance(stacked, _Layer)
    assert stacked.activation == "tanh"
    assert stacked.weight.axes == (Layers, Axis("embed", 3), Axis("out", 3))
    assert stacked.bias.axes == (Layers, Axis("embed", 3))
    for i in range(Layers.size):
        one = _make_layer(keys[i])
        close(stacked.weight.array[i], one.weight.array)
        close(stacked.bias.array[i], one.bias.array)
    # the same keys given by keyword
    by_keyword = nt.vmap(lambda *, key: _make_layer(key), Layers, map_plain=["key"])(key=keys)
    close(by_keyword.weight.array, stacked.weight.array)


def test_vmap_applies_stacked_module_per_layer():
    Layers = Axis("layers", 3)
    stacked = nt.vmap(_make_layer, Layers, map_plain=[0])(jax.random.split(jax.random.key(1), 3))
    x = rand({"batch": 2, "embed": 3}, 5)
    y = nt.vmap(lambda layer, x1: layer(x1), Layers)(stacked, x)
    assert y.axis_names == ("layers", "batch", "embed")
    for i in range(3):
        ref = jnp.tanh(x.array @ stacked.weight.array[i] + stacked.bias.array[i][None, :])
        close(y.array[i], ref)


def test_nested_vmap_over_two_axes():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    y = nt.vmap(nt.vmap(lambda v: nt.sum(v * v, "embed"), "position"), "batch")(x)
    assert y.axis_names == ("batch", "position")
    close(y.array, jnp.sum(x.array**2, axis=-1))


def test_vmap_under_jit_and_grad():
    x = rand({"batch": 4, "embed": 3}, 1)
    w = rand({"embed": 3}, 2)

    def loss(w1):
        per_example = nt.vmap(lambda xi, wi: nt.sum(nt.tanh(xi * wi), "embed"), "batch")(x, w1)
        return nt.sum(per_example).array

    def reference(w_raw):
        return jnp.sum(jax.vmap(lambda xi: jnp.sum(jnp.tanh(xi * w_raw)))(x.array))

    close(jax.jit(loss)(w), reference(w.array))
    g = jax.jit(jax.grad(loss))(w)
    assert g.axis_names == ("embed",)
    close(g.array, jax.grad(reference)(w.array))


def test_vmap_errors():
    x = rand({"batch": 4, "embed": 3}, 1)
    with pytest.raises(ValueError, match=r"vmap: no argument has axis 'layers', so its size is unknown"):
        nt.vmap(lambda v: v, "layers")(x)
    with pytest.raises(
        ValueError,
        match=r"vmap: axis 'batch' has different sizes in the arguments: \['\(batch=4, embed=3\)', '\(batch=5\)'\]",
    ):
        nt.vmap(lambda a, b: a, "batch")(x, rand({"batch": 5}, 2))
    with pytest.raises(ValueError, match=r"axis 'batch' has different sizes.*asked for size 7"):
        nt.vmap(lambda a: a, Axis("batch", 7))(x)
    with pytest.raises(ValueError, match=r"map_plain: no positional argument 2; the call has 1"):
        nt.vmap(lambda a: a, "batch", map_plain=[2])(x)
    with pytest.raises(ValueError, match=r"map_plain: no keyword argument 'key'; the call has \['k'\]"):
        nt.vmap(lambda k: k, "batch", map_plain=["key"])(k=x)
    with pytest.raises(ValueError, match=r"a 0-d plain array cannot be mapped over axis 'batch'"):
        nt.vmap(lambda a, s: a, "batch", map_plain=[1])(x, jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"axis 'batch' has different sizes.*plain array of shape \(2,\)"):
        nt.vmap(lambda a, s: a, "batch", map_plain=[1])(x, jnp.zeros(2))


# -- scan / fold --------------------------------------------------------------------------------------------


def test_scan_matches_lax_scan_with_axis_not_leading():
    xs = rand({"embed": 3, "position": 5}, 1)
    w = rand({"embed": 3, "out": 3}, 2)  # no position axis: seen whole by every step
    init = nt.named(jnp.zeros(3), ("out",))

    def step(h, x_t, w1):
        assert x_t.axis_names == ("embed",)
        h = nt.tanh(nt.dot(x_t, w1, axis="embed") + h)
        return h, h * 2.0

    h, ys = nt.scan(step, "position")(init, xs, w)
    assert h.axes == (Axis("out", 3),)
    assert ys.axes == (Axis("position", 5), Axis("out", 3))

    def ref_step(h, x_t):
        h = jnp.tanh(x_t @ w.array + h)
        return h, h * 2.0

    ref_h, ref_ys = jax.lax.scan(ref_step, jnp.zeros(3), xs.array.T)
    close(h.array, ref_h)
    close(ys.array, ref_ys)


@SETTINGS
@given(st.booleans(), st.sampled_from([1, 2, 5, True]), st.booleans())
def test_scan_reverse_unroll_remat_match_lax_scan(reverse, unroll, remat):
    xs = rand({"position": 5, "embed": 2}, 3)

    def step(c, x_t):
        c = c * 0.5 + nt.sin(x_t)
        return c, nt.sum(c, "embed")

    init = nt.named(jnp.ones(2), ("embed",))
    c, ys = nt.scan(step, "position", reverse=reverse, unroll=unroll, remat=remat)(init, xs)

    def ref_step(c, x_t):
        c = c * 0.5 + jnp.sin(x_t)
        return c, jnp.sum(c)

    ref_c, ref_ys = jax.lax.scan(ref_step, jnp.ones(2), xs.array, reverse=reverse)
    close(c.array, ref_c)
    close(ys.array, ref_ys)
    assert ys.axes == (Axis("position", 5),)


def test_scan_over_several_xs_pytrees_and_plain_outputs():
    a = rand({"layers": 3, "embed": 2}, 1)
    b = {"m": rand({"embed": 2, "layers": 3}, 2), "k": jnp.float32(1.5)}

    def step(c, a_t, b_t):
        c = c + a_t * b_t["m"] * b_t["k"]
        return c, {"raw": nt.sum(c).array, "tag": "x"}

    init = nt.named(jnp.zeros(2), ("embed",))
    c, ys = nt.scan(step, "layers")(init, a, b)
    products = a.array * b["m"].array.T * 1.5
    close(c.array, jnp.sum(products, axis=0))
    close(ys["raw"], jnp.cumsum(jnp.sum(products, axis=1)))
    assert ys["tag"] == "x"


def test_scan_under_jit_and_grad_with_remat():
    xs = rand({"position": 6, "embed": 3}, 1)
    w = rand({"embed": 3, "out": 3}, 2)

    def loss(w1, remat):
        def step(h, x_t):
            h = nt.tanh(nt.dot(x_t + h, w1, axis="embed").rename({"out": "embed"}))
            return h, None

        h, _ = nt.scan(step, "position", remat=remat)(nt.named(jnp.zeros(3), ("embed",)), xs)
        return nt.sum(h * h).array

    def reference(w_raw):
        def step(h, x_t):
            return jnp.tanh((x_t + h) @ w_raw), None

        h, _ = jax.lax.scan(step, jnp.zeros(3), xs.array)
        return jnp.sum(h * h)

    expected = jax.grad(reference)(w.array)
    for remat in (False, True):
        close(jax.jit(lambda w1, r=remat: loss(w1, r))(w), reference(w.array))
        g = jax.jit(jax.grad(lambda w1, r=remat: loss(w1, r)))(w)
        assert g.axis_names == ("embed", "out")
        close(g.array, expected)


def test_scan_with_axis_object_and_nothing_to_scan_counts_steps():
    Steps = Axis("step", 4)
    c, ys = nt.scan(lambda c: (c + 1.0, c), Steps)(jnp.float32(0.0))
    close(c, 4.0)
    close(ys, jnp.arange(4.0))


def test_fold_returns_only_the_carry():
    xs = rand({"layers": 4, "embed": 3}, 1)
    init = nt.named(jnp.zeros(3), ("embed",))
    out = nt.fold(lambda c, x_t: c * 0.9 + x_t, "layers")(init, xs)
    ref, _ = jax.lax.scan(lambda c, x_t: (c * 0.9 + x_t, None), jnp.zeros(3), xs.array)
    assert out.axes == (Axis("embed", 3),)
    close(out.array, ref)
    rev = nt.fold(lambda c, x_t: c * 0.9 + x_t, "layers", reverse=True, unroll=2, remat=True)(init, xs)
    ref_rev, _ = jax.lax.scan(lambda c, x_t: (c * 0.9 + x_t, None), jnp.zeros(3), xs.array, reverse=True)
    close(rev.array, ref_rev)


def test_fold_applies_stacked_layers_under_grad():
    Layers = Axis("layers", 3)
    stacked = nt.vmap(_make_layer, Layers, map_plain=[0])(jax.random.split(jax.random.key(2), 3))
    x = rand({"batch": 2, "embed": 3}, 4)

    def loss(model):
        return nt.sum(nt.fold(lambda h, layer: layer(h), Layers)(x, model)).array

    def reference(weights, biases):
        h = x.array
        for i in range(3):
            h = jnp.tanh(h @ weights[i] + biases[i][None, :])
        return jnp.sum(h)

    close(loss(stacked), reference(stacked.weight.array, stacked.bias.array))
    g = eqx.filter_jit(eqx.filter_grad(loss))(stacked)
    gw, gb = jax.grad(reference, argnums=(0, 1))(stacked.weight.array, stacked.bias.array)
    assert g.weight.axes == stacked.weight.axes
    close(g.weight.array, gw)
    close(g.bias.array, gb)


def test_scan_errors():
    xs = rand({"position": 4, "embed": 3}, 1)
    init = nt.named(jnp.zeros(3), ("embed",))
    with pytest.raises(ValueError, match=r"scan: no argument has axis 'layers', so its size is unknown"):
        nt.scan(lambda c, x: (c, x), "layers")(init, xs)
    with pytest.raises(ValueError, match=r"fold: no argument has axis 'layers'"):
        nt.fold(lambda c, x: c, "layers")(init, xs)
    with pytest.raises(ValueError, match=r"scan: axis 'position' has different sizes in the arguments"):
        nt.scan(lambda c, a, b: (c, a), "position")(init, xs, rand({"position": 5}, 2))
    with pytest.raises(ValueError, match=r"fold: axis 'position' has different sizes.*asked for size 9"):
        nt.fold(lambda c, x: c, Axis("position", 9))(init, xs)


def test_vmap_output_that_already_has_the_axis_is_an_error():
    x = rand({"batch": 2, "embed": 3}, 1)
    with pytest.raises(ValueError, match=r"vmap: an output already has axis 'batch' \(batch=4\)"):
        nt.vmap(lambda v: nt.named(jnp.zeros(4), ("batch",)), "batch")(x)


def test_scan_remat_accepts_a_checkpoint_policy():
    xs = rand({"position": 4, "embed": 3}, 1)
    w = rand({"embed": 3, "out": 3}, 2)

    def loss(w1, remat):
        def step(h, x_t):
            return nt.tanh(nt.dot(x_t + h, w1, axis="embed").rename({"out": "embed"})), None

        h, _ = nt.scan(step, "position", remat=remat)(nt.named(jnp.zeros(3), ("embed",)), xs)
        return nt.sum(h).array

    plain = jax.grad(loss)(w, False)
    policy = jax.grad(loss)(w, jax.checkpoint_policies.dots_saveable)
    close(policy.array, plain.array)

    # the policy really reaches jax.checkpoint: its marker appears in the traced program
    def traced(remat):
        return str(jax.make_jaxpr(lambda w1: jax.grad(loss)(w1, remat))(w))

    assert "remat" in traced(jax.checkpoint_policies.dots_saveable)
    assert "remat" not in traced(False)


def test_scan_and_fold_map_plain_arrays_over_their_leading_dimension():
    xs = rand({"embed": 2, "layers": 3}, 1)
    per_step = jnp.arange(3.0)  # plain: scanned only because map_plain lists its position in xs
    whole = jnp.float32(10.0)
    init = nt.named(jnp.zeros(2), ("embed",))

    def step(c, x_t, p_t, w):
        assert p_t.shape == ()
        return c + x_t * p_t + w, p_t * 2.0

    c, ys = nt.scan(step, "layers", map_plain=[1])(init, xs, per_step, whole)
    close(ys, per_step * 2.0)
    close(c.array, xs.array @ per_step + 30.0)
    folded = nt.fold(lambda c, x_t, p_t, w: step(c, x_t, p_t, w)[0], "layers", map_plain=[1])(init, xs, per_step, whole)
    close(folded.array, c.array)
    with pytest.raises(ValueError, match=r"scan: axis 'layers' has different sizes.*plain array of shape \(4,\)"):
        nt.scan(step, "layers", map_plain=[1])(init, xs, jnp.zeros(4), whole)
    with pytest.raises(ValueError, match=r"map_plain: no positional argument 5; the call has 3"):
        nt.scan(step, "layers", map_plain=[5])(init, xs, per_step, whole)
