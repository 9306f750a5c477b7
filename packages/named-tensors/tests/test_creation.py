"""zeros, ones, full, arange and the *_like forms, against jax.numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import named_tensors as nt

FAST = settings(max_examples=25, deadline=None)


@st.composite
def axes_lists(draw):
    names = draw(st.lists(st.sampled_from(("a", "b", "c")), unique=True, max_size=3))
    return tuple(nt.Axis(n, draw(st.integers(0, 4))) for n in names)


@FAST
@given(axes=axes_lists(), dtype=st.sampled_from([None, jnp.float32, jnp.int32, jnp.bfloat16, jnp.bool_]))
def test_constant_arrays_match_jnp(axes, dtype):
    shape = tuple(a.size for a in axes)
    for fn, ref in ((nt.zeros, jnp.zeros), (nt.ones, jnp.ones)):
        out = fn(axes, dtype=dtype)
        expected = ref(shape, dtype=dtype)
        assert out.axes == axes and out.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(out.array), np.asarray(expected))
    filled = nt.full(axes, 3, dtype=dtype)
    expected = jnp.full(shape, 3, dtype=dtype)
    assert filled.axes == axes and filled.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(filled.array), np.asarray(expected))


def test_default_dtypes_follow_jnp():
    a = nt.Axis("a", 2)
    assert nt.zeros(a).dtype == jnp.float32 and nt.zeros(a).axes == (a,)
    assert nt.ones([a]).dtype == jnp.float32
    assert nt.full(a, 7).dtype == jnp.int32
    assert nt.full(a, 0.5).dtype == jnp.float32
    assert nt.full(a, True).dtype == jnp.bool_
    assert nt.zeros(()).axes == () and float(nt.zeros(()).array) == 0.0


@FAST
@given(
    size=st.integers(0, 6),
    start=st.one_of(st.integers(-5, 5), st.floats(-5, 5, width=32)),
    step=st.one_of(st.integers(-3, 3), st.floats(-3, 3, width=32)),
)
def test_arange_is_start_plus_step_times_position(size, start, step):
    axis = nt.Axis("position", size)
    out = nt.arange(axis, start=start, step=step)
    assert out.axes == (axis,)
    is_float = isinstance(start, float) or isinstance(step, float)
    assert out.dtype == (jnp.float32 if is_float else jnp.int32)
    ref = np.float32(start) + np.float32(step) * np.arange(size, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(out.array, np.float64), ref, rtol=1e-6, atol=1e-5)


def test_arange_defaults_dtype_and_traced_start():
    pos = nt.Axis("position", 4)
    np.testing.assert_array_equal(np.asarray(nt.arange(pos).array), [0, 1, 2, 3])
    as_float = nt.arange(pos, start=1, dtype=jnp.float32)
    assert as_float.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(as_float.array), [1.0, 2.0, 3.0, 4.0])
    # A traced start (a position offset inside jit) keeps its own dtype.
    shifted = jax.jit(lambda s: nt.arange(pos, start=s, step=2))(jnp.int32(10))
    assert shifted.axes == (pos,) and shifted.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(shifted.array), [10, 12, 14, 16])


@FAST
@given(axes=axes_lists(), dtype=st.sampled_from([None, jnp.float32, jnp.int32]))
def test_like_forms_keep_axes_and_dtype(axes, dtype):
    x = nt.named(jnp.full(tuple(a.size for a in axes), 2.5, jnp.bfloat16), axes)
    for fn, ref in ((nt.zeros_like, jnp.zeros_like), (nt.ones_like, jnp.ones_like)):
        out = fn(x, dtype=dtype)
        expected = ref(x.array, dtype=dtype)
        assert out.axes == x.axes and out.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(out.array, np.float32), np.asarray(expected, np.float32))
    filled = nt.full_like(x, 4, dtype=dtype)
    assert filled.axes == x.axes and filled.dtype == (dtype or jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(filled.array, np.float32), 4.0)


def test_creation_under_jit_and_grad():
    a, b = nt.Axis("a", 2), nt.Axis("b", 3)
    x = nt.named(jnp.arange(6.0).reshape(2, 3), (a, b))

    def f(x):
        return nt.sum(x * nt.full_like(x, 2.0) + nt.ones((b, a)) * x).scalar()

    g = jax.jit(jax.grad(f))(x)
    assert g.axes == x.axes
    np.testing.assert_array_equal(np.asarray(g.array), np.full((2, 3), 3.0))


def test_creation_errors_name_the_axes():
    a = nt.Axis("a", 2)
    with pytest.raises(TypeError, match=r"zeros needs Axis objects \(name and size\), got 'a'"):
        nt.zeros(("a",))
    with pytest.raises(TypeError, match=r"ones needs Axis objects \(name and size\), got 'b'"):
        nt.ones((a, "b"))
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['a'\]"):
        nt.full((a, a), 1.0)
    with pytest.raises(TypeError, match=r"full takes a scalar fill_value; to spread a NamedArray over axes"):
        nt.full(a, nt.ones(a))
    with pytest.raises(TypeError, match=r"arange needs an Axis \(name and size\), got 'a'"):
        nt.arange("a")
    with pytest.raises(TypeError, match="zeros_like takes a NamedArray, got ArrayImpl"):
        nt.zeros_like(jnp.zeros(2))
    with pytest.raises(TypeError, match="full_like takes a NamedArray, got ndarray"):
        nt.full_like(np.zeros(2), 1)
