"""Reductions, activations, softmax family and selection over named axes, against plain numpy and jax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import named_tensors as nt

FEW = settings(max_examples=10, deadline=None)
FAST = settings(max_examples=25, deadline=None)
NAMES = ("a", "b", "c")


@st.composite
def array_and_axes(draw, min_axes=1):
    """A random float32 NamedArray (axes in random order) and a random ordered subset of its axis names."""
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, min_size=min_axes, max_size=3))
    sizes = [draw(st.sampled_from((1, 2, 3))) for _ in names]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = nt.named(jnp.asarray(rng.standard_normal(sizes).astype(np.float32)), names)
    chosen = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
    return x, chosen


def positions(x, names):
    return tuple(x.axis_names.index(n) for n in names)


def kept_names(x, names):
    return tuple(n for n in x.axis_names if n not in names)


REDUCTIONS = {
    "sum": np.sum,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
    "prod": np.prod,
    "std": np.std,
    "var": np.var,
}


@FEW
@given(case=array_and_axes())
def test_reductions_match_numpy_over_named_axes(case):
    x, chosen = case
    ref_arr = np.asarray(x.array, np.float64)
    for name, ref_fn in REDUCTIONS.items():
        fn = getattr(nt, name)
        out = fn(x, chosen)
        assert out.axis_names == kept_names(x, chosen), name
        np.testing.assert_allclose(
            np.asarray(out.array), ref_fn(ref_arr, axis=positions(x, chosen)), rtol=1e-4, atol=1e-5, err_msg=name
        )
        whole = fn(x)  # axis=None: every axis
        assert whole.axes == ()
        np.testing.assert_allclose(np.asarray(whole.array), ref_fn(ref_arr), rtol=1e-4, atol=1e-5, err_msg=name)
    positive = x > 0
    for name, ref_fn in {"all": np.all, "any": np.any}.items():
        out = getattr(nt, name)(positive, chosen)
        assert out.axis_names == kept_names(x, chosen)
        np.testing.assert_array_equal(np.asarray(out.array), ref_fn(ref_arr > 0, axis=positions(x, chosen)))


@FEW
@given(case=array_and_axes(), data=st.data())
def test_reductions_with_a_mask_broadcast_by_name(case, data):
    x, chosen = case
    mask_names = data.draw(st.lists(st.sampled_from(x.axis_names), unique=True))
    mask = nt.permute(x > 0, [*mask_names, ...])
    for n in x.axis_names:
        if n not in mask_names:
            mask = nt.any(mask, n)
    # numpy reference: the mask laid out like x, broadcast over the axes it lacks
    mask_full = np.asarray(nt.broadcast_to(mask, x.axes).array)
    ref_arr = np.asarray(x.array, np.float64)
    pos = positions(x, chosen)
    np.testing.assert_allclose(
        np.asarray(nt.sum(x, chosen, where=mask).array), np.sum(ref_arr, axis=pos, where=mask_full), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(nt.max(x, chosen, where=mask, initial=-10.0).array),
        np.max(ref_arr, axis=pos, where=mask_full, initial=-10.0),
        rtol=1e-6,
    )


def test_reduction_mask_broadcast_is_independent_of_axis_order():
    a, b = nt.Axis("a", 3), nt.Axis("b", 4)
    x = nt.named(jnp.arange(12.0).reshape(3, 4), (a, b))
    mask = nt.named(jnp.array([True, False, True, True]), (b,))
    by_row = nt.sum(x, "b", where=mask)
    np.testing.assert_allclose(np.asarray(by_row.array), np.array([0 + 2 + 3, 4 + 6 + 7, 8 + 10 + 11.0]))
    transposed = nt.sum(x.permute("b", "a"), "b", where=mask)
    np.testing.assert_array_equal(transposed.array, by_row.array)


@FAST
@given(case=array_and_axes())
def test_argmax_argmin_match_numpy(case):
    x, _ = case
    arr = np.asarray(x.array)
    for name in x.axis_names:
        i = x.axis_names.index(name)
        assert nt.argmax(x, name).axis_names == kept_names(x, [name])
        np.testing.assert_array_equal(np.asarray(nt.argmax(x, name).array), np.argmax(arr, axis=i))
        np.testing.assert_array_equal(np.asarray(nt.argmin(x, name).array), np.argmin(arr, axis=i))
    assert int(nt.argmax(x, None).array) == np.argmax(arr)
    assert int(nt.argmin(x, None).array) == np.argmin(arr)


def test_reduction_errors_name_the_axes():
    x = nt.zeros((nt.Axis("a", 2), nt.Axis("b", 3)))
    with pytest.raises(ValueError, match=r"Unknown axis 'z': this array has axes \(a=2, b=3\)"):
        nt.sum(x, "z")
    with pytest.raises(ValueError, match=r"Axis named twice in reduction: \['a', 'a'\]"):
        nt.mean(x, ["a", "a"])
    with pytest.raises(ValueError, match=r"Unknown axis 'z'"):
        nt.argmax(x, "z")
    with pytest.raises(ValueError, match=r"Axis 'b' has size 3 in array with axes \(a=2, b=3\), but size 4"):
        nt.max(x, nt.Axis("b", 4))
    with pytest.raises(ValueError, match=r"axes \['c'\] are not in the target"):
        nt.sum(x, "a", where=nt.ones(nt.Axis("c", 2)) > 0)
    with pytest.raises(ValueError, match=r"Unknown axis 'z'"):
        nt.softmax(x, "z")


UNARY = {
    "relu": lambda v: np.maximum(v, 0),
    "silu": lambda v: v / (1 + np.exp(-v)),
    "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
    "tanh": np.tanh,
    "exp": np.exp,
    "square": np.square,
    "abs": np.abs,
    "sin": np.sin,
    "cos": np.cos,
}


def _gelu_tanh(v):
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


def _gelu_exact(v):
    from math import erf

    return 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2)))


@FEW
@given(case=array_and_axes())
def test_unary_functions_keep_axes_and_match_numpy(case):
    x, _ = case
    v = np.asarray(x.array, np.float64)
    for name, ref in UNARY.items():
        out = getattr(nt, name)(x)
        assert out.axes == x.axes, name
        np.testing.assert_allclose(np.asarray(out.array), ref(v), rtol=1e-5, atol=1e-6, err_msg=name)
    pos = abs(x) + 0.5
    pv = np.abs(v) + 0.5
    np.testing.assert_allclose(np.asarray(nt.log(pos).array), np.log(pv), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(nt.sqrt(pos).array), np.sqrt(pv), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(nt.rsqrt(pos).array), 1 / np.sqrt(pv), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(nt.gelu(x).array), _gelu_tanh(v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(nt.gelu(x, approximate=False).array), _gelu_exact(v), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(nt.logical_not(x > 0).array), ~(v > 0))
    np.testing.assert_array_equal(np.asarray(nt.isfinite(nt.log(x)).array), v > 0)  # log(<0) is nan
    np.testing.assert_array_equal(np.asarray(nt.stop_gradient(x).array), np.asarray(x.array))


def test_unary_functions_refuse_unnamed_input():
    with pytest.raises(TypeError, match="relu takes a NamedArray, got ArrayImpl"):
        nt.relu(jnp.ones(3))
    with pytest.raises(TypeError, match="exp takes a NamedArray, got float"):
        nt.exp(1.0)


@FEW
@given(case=array_and_axes())
def test_softmax_family_matches_numpy(case):
    x, chosen = case
    if not chosen:
        chosen = [x.axis_names[0]]
    v = np.asarray(x.array, np.float64)
    pos = positions(x, chosen)
    shifted = v - v.max(axis=pos, keepdims=True)
    ref_lse = np.log(np.exp(shifted).sum(axis=pos, keepdims=True)) + v.max(axis=pos, keepdims=True)
    ref_softmax = np.exp(v - ref_lse)
    out = nt.softmax(x, chosen)
    assert out.axes == x.axes
    np.testing.assert_allclose(np.asarray(out.array), ref_softmax, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(nt.log_softmax(x, chosen).array), v - ref_lse, rtol=1e-5, atol=1e-5)
    lse = nt.logsumexp(x, chosen)
    assert lse.axis_names == kept_names(x, chosen)
    np.testing.assert_allclose(np.asarray(lse.array), np.squeeze(ref_lse, axis=pos), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(nt.logsumexp(x).array), np.log(np.exp(v).sum()), rtol=1e-5, atol=1e-5)


def test_softmax_and_logsumexp_gradients_under_jit_match_jax():
    a, v = nt.Axis("batch", 3), nt.Axis("vocab", 5)
    x = nt.random.normal(jax.random.key(0), (v, a))
    w = nt.random.normal(jax.random.key(1), (a, v))

    def loss(x):
        return nt.sum(nt.log_softmax(x, "vocab") * w + nt.logsumexp(x, "vocab")).scalar()

    def ref(xa):  # xa laid out (vocab, batch), w laid out (batch, vocab)
        lsm = jax.nn.log_softmax(xa, axis=0)
        return jnp.sum(lsm * w.array.T + jax.nn.logsumexp(xa, axis=0)[None, :])

    g = jax.jit(jax.grad(loss))(x)
    assert g.axes == x.axes
    np.testing.assert_allclose(np.asarray(g.array), np.asarray(jax.grad(ref)(x.array)), rtol=1e-5, atol=1e-6)


@FEW
@given(case=array_and_axes(), data=st.data())
def test_where_clip_maximum_minimum_broadcast_by_name(case, data):
    x, chosen = case
    y = nt.permute(nt.sum(x, chosen) * 0.5, data.draw(st.permutations(kept_names(x, chosen))))
    xv = np.asarray(x.array)
    yv = np.asarray(nt.broadcast_to(y, x.axes).array)  # y laid out like x
    np.testing.assert_array_equal(
        np.asarray(nt.where(x > y, x, y).permute(*x.axis_names).array), np.where(xv > yv, xv, yv)
    )
    np.testing.assert_array_equal(np.asarray(nt.where(x > 0, x, 0.0).array), np.where(xv > 0, xv, 0.0))
    np.testing.assert_array_equal(np.asarray(nt.maximum(y, x).permute(*x.axis_names).array), np.maximum(xv, yv))
    np.testing.assert_array_equal(np.asarray(nt.minimum(x, y).array), np.minimum(xv, yv))
    np.testing.assert_array_equal(np.asarray(nt.clip(x, -0.5, 0.5).array), np.clip(xv, -0.5, 0.5))
    np.testing.assert_array_equal(np.asarray(nt.clip(x, y - 0.1, y + 0.1).array), np.clip(xv, yv - 0.1, yv + 0.1))


def test_where_and_binary_selection_errors():
    x = nt.ones((nt.Axis("a", 2),))
    with pytest.raises(TypeError, match="where needs at least one NamedArray among condition, x and y"):
        nt.where(True, 1.0, 2.0)
    with pytest.raises(ValueError, match="Axis 'a' has size 2 in one array and 3 in another"):
        nt.maximum(x, nt.ones(nt.Axis("a", 3)))
    with pytest.raises(TypeError, match=r"clip: cannot combine a NamedArray with an unnamed array of shape \(2,\)"):
        nt.clip(x, jnp.zeros(2), 1.0)
