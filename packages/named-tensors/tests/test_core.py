"""Axis, NamedArray, broadcasting by name, permute/rename/broadcast_to and dot, against plain numpy."""

import operator
import string

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import named_tensors as nt

FAST = settings(max_examples=25, deadline=None)
# Every new shape costs an XLA compilation per op: fewer examples where each one compiles a lot.
FEW = settings(max_examples=10, deadline=None)
NAMES = ("a", "b", "c", "d")


def aligned(xp, arr, names, target):
    """arr (dims named `names`) laid out as `target`, with size-1 dims for the names it lacks."""
    missing = [n for n in target if n not in names]
    full = list(names) + missing
    expanded = xp.reshape(arr, tuple(arr.shape) + (1,) * len(missing))
    return xp.transpose(expanded, [full.index(n) for n in target])


def in_order(result: nt.NamedArray, ref: np.ndarray, ref_names) -> np.ndarray:
    """ref (dims named ref_names) transposed to the result's axis order."""
    assert sorted(result.axis_names) == sorted(ref_names)
    return np.transpose(ref, [list(ref_names).index(n) for n in result.axis_names])


@st.composite
def named_arrays(draw, count=2, min_axes=0):
    """`count` random float32 NamedArrays over random subsets (in random orders) of shared sized axes."""
    sizes = {n: draw(st.sampled_from((1, 2, 3))) for n in NAMES}
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = []
    for _ in range(count):
        names = draw(st.lists(st.sampled_from(NAMES), unique=True, min_size=min_axes, max_size=3))
        value = rng.standard_normal([sizes[n] for n in names]).astype(np.float32)
        arrays.append(nt.named(jnp.asarray(value), [nt.Axis(n, sizes[n]) for n in names]))
    return arrays


def union_names(*arrays):
    out = []
    for a in arrays:
        out += [n for n in a.axis_names if n not in out]
    return out


# -- Axis -----------------------------------------------------------------------------------------------------


def test_axis_alias_resize_and_repr():
    pos = nt.Axis("position", 8)
    assert pos.alias("key_position") == nt.Axis("key_position", 8)
    assert pos.resize(3) == nt.Axis("position", 3)
    assert repr(pos) == "Axis('position', 8)"
    assert nt.Axis("a", np.int64(3)).size == 3 and type(nt.Axis("a", np.int64(3)).size) is int


@pytest.mark.parametrize(
    ("name", "size", "message"),
    [
        ("", 3, "Axis name must be a non-empty string, got ''"),
        (3, 3, "Axis name must be a non-empty string, got 3"),
        ("a", -1, "Axis 'a' needs a non-negative int size, got -1"),
        ("a", True, "Axis 'a' needs a non-negative int size, got True"),
        ("a", 2.0, "Axis 'a' needs a non-negative int size, got 2.0"),
    ],
)
def test_axis_rejects_bad_name_or_size(name, size, message):
    with pytest.raises(TypeError, match=message.replace("(", r"\(")):
        nt.Axis(name, size)


def test_axis_name_and_as_axis_tuple():
    assert nt.axis_name(nt.Axis("a", 2)) == "a"
    assert nt.axis_name("b") == "b"
    with pytest.raises(TypeError, match="Expected an Axis or an axis name, got 3"):
        nt.axis_name(3)
    assert nt.as_axis_tuple(None) == ()
    assert nt.as_axis_tuple("a") == ("a",)
    assert nt.as_axis_tuple([nt.Axis("a", 1), "b"]) == (nt.Axis("a", 1), "b")


# -- NamedArray construction and lookup -------------------------------------------------------------------


def test_named_takes_sizes_from_the_array_and_checks_given_ones():
    x = nt.named(jnp.zeros((2, 3)), ("batch", nt.Axis("embed", 3)))
    assert x.axes == (nt.Axis("batch", 2), nt.Axis("embed", 3))
    assert x.shape == {"batch": 2, "embed": 3}
    assert x.axis_names == ("batch", "embed")
    assert (x.ndim, x.size, x.dtype) == (2, 6, jnp.float32)
    assert nt.named(jnp.float32(1.5), ()).ndim == 0
    assert nt.named(jnp.arange(4), "a").axes == (nt.Axis("a", 4),)


def test_named_errors_name_the_axes():
    with pytest.raises(ValueError, match=r"shape \(2, 3\) has 2 dimensions but 1 axes were given: \['a'\]"):
        nt.named(jnp.zeros((2, 3)), ("a",))
    with pytest.raises(ValueError, match="Axis 'b' has size 4, but the array's dimension there has size 3"):
        nt.named(jnp.zeros((2, 3)), ("a", nt.Axis("b", 4)))
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['a'\] in axes \['a', 'a'\]"):
        nt.named(jnp.zeros((2, 2)), ("a", "a"))


def test_namedarray_constructor_checks_axes():
    with pytest.raises(ValueError, match=r"shape \(2, 3\) does not fit axes \(a=3, b=2\)"):
        nt.NamedArray(jnp.zeros((2, 3)), [nt.Axis("a", 3), nt.Axis("b", 2)])
    with pytest.raises(TypeError, match="NamedArray axes must be Axis objects, got 'a'"):
        nt.NamedArray(jnp.zeros((2,)), ["a"])
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['a'\]"):
        nt.NamedArray(jnp.zeros((2, 2)), [nt.Axis("a", 2), nt.Axis("a", 2)])


def test_axis_lookup_by_name_or_axis():
    x = nt.zeros((nt.Axis("a", 2), nt.Axis("b", 3)))
    assert x.axis_index("b") == 1 and x.axis_index(nt.Axis("a", 2)) == 0
    assert x.resolve_axis("b") == nt.Axis("b", 3)
    assert x.axis_size("a") == 2
    assert x.has_axis("a") and x.has_axis(["a", nt.Axis("b", 3)]) and not x.has_axis(["a", "z"])
    with pytest.raises(ValueError, match=r"Unknown axis 'z': this array has axes \(a=2, b=3\)"):
        x.axis_index("z")
    with pytest.raises(ValueError, match=r"Axis 'a' has size 2 in array with axes \(a=2, b=3\), but size 5"):
        x.axis_index(nt.Axis("a", 5))


def test_python_conversions_and_their_errors():
    x = nt.named(jnp.float32(2.5), ())
    assert float(x) == 2.5 and int(x) == 2 and bool(x) and x.item() == 2.5
    assert x.scalar() == jnp.float32(2.5)
    v = nt.named(jnp.arange(3), "a")
    assert len(v) == 3
    assert repr(v) == "NamedArray((a=3), dtype=int32)"
    with pytest.raises(TypeError, match="len\\(\\) of a 0-d NamedArray"):
        len(x)
    with pytest.raises(ValueError, match=r"scalar\(\) needs a 0-d array, this one has axes \(a=3\)"):
        v.scalar()
    assert v.astype(jnp.float32).dtype == jnp.float32


def test_jax_array_conversion_is_refused():
    x = nt.ones(nt.Axis("a", 3))
    message = "A NamedArray cannot be used where a positional jax array is expected"
    with pytest.raises(TypeError, match=message):
        jnp.sum(x)
    with pytest.raises(TypeError, match=message):
        jnp.asarray(x)
    with pytest.raises(TypeError, match=message):
        jnp.ones(3) + x


def test_matmul_is_refused_with_a_pointer_to_dot():
    x = nt.ones(nt.Axis("a", 3))
    with pytest.raises(TypeError, match=r"no positional matrix product \(@\); use nt.dot"):
        x @ x
    with pytest.raises(TypeError, match=r"no positional matrix product \(@\); use nt.dot"):
        np.ones(3) @ x


# -- broadcasting by name ---------------------------------------------------------------------------------

ARITHMETIC = [operator.add, operator.sub, operator.mul, operator.truediv, operator.pow]
COMPARISONS = [operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne]


def _operands(op, x, y):
    if op is operator.pow:  # a positive base keeps real results
        return abs(x) + 0.5, y
    if op is operator.truediv:
        return x, abs(y) + 0.5
    return x, y


def _check_aligned(op, x, y, exact):
    target = union_names(x, y)
    ref = op(
        aligned(np, np.asarray(x.array), x.axis_names, target),
        aligned(np, np.asarray(y.array), y.axis_names, target),
    )
    result = op(x, y)
    assert result.axis_names == tuple(target), op
    if exact:
        np.testing.assert_array_equal(np.asarray(result.array), in_order(result, ref, target), err_msg=str(op))
    else:
        np.testing.assert_allclose(np.asarray(result.array), in_order(result, ref, target), rtol=1e-5, err_msg=str(op))
    # Reversing x's positional order changes nothing but the layout.
    flipped = op(nt.permute(x, x.axis_names[::-1]), y)
    np.testing.assert_array_equal(np.asarray(nt.permute(flipped, result.axis_names).array), result.array)


@FEW
@given(arrays=named_arrays())
def test_binary_ops_align_axes_by_name(arrays):
    x, y = arrays
    for op in ARITHMETIC + COMPARISONS:
        _check_aligned(op, *_operands(op, x, y), exact=op in COMPARISONS)
    xi, yi = (nt.NamedArray((a.array * 10).astype(jnp.int32), a.axes) for a in arrays)
    for op in (operator.floordiv, operator.mod):
        _check_aligned(op, xi, abs(yi) + 1, exact=True)
    for op in (operator.and_, operator.or_, operator.xor):
        _check_aligned(op, x > 0, y > 0, exact=True)


@FEW
@given(arrays=named_arrays(count=1))
def test_scalars_and_unary_operators(arrays):
    (x,) = arrays
    ref = np.asarray(x.array)
    np.testing.assert_allclose(np.asarray((2 - x).array), 2 - ref, rtol=1e-6)
    np.testing.assert_allclose(np.asarray((x * 3.0).array), ref * 3.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray((2.0 / (abs(x) + 1)).array), 2.0 / (np.abs(ref) + 1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray((np.float32(2) * x).array), 2 * ref, rtol=1e-6)
    np.testing.assert_allclose(np.asarray((x + jnp.float32(1)).array), ref + 1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray((-x).array), -ref)
    np.testing.assert_allclose(np.asarray((+x).array), ref)
    np.testing.assert_allclose(np.asarray(abs(x).array), np.abs(ref))
    np.testing.assert_array_equal(np.asarray((~(x > 0)).array), ~(ref > 0))
    assert (x * 3.0).axes == x.axes


def test_size_mismatch_between_same_named_axes_is_an_error():
    x = nt.ones((nt.Axis("a", 2), nt.Axis("b", 3)))
    y = nt.ones((nt.Axis("b", 4),))
    with pytest.raises(ValueError, match="Axis 'b' has size 3 in one array and 4 in another"):
        x + y
    with pytest.raises(ValueError, match="Axis 'b' has size 3 in one array and 4 in another"):
        _ = x < y


def test_unnamed_array_operand_is_an_error():
    x = nt.ones(nt.Axis("a", 3))
    with pytest.raises(TypeError, match=r"__add__: cannot combine a NamedArray with an unnamed array of shape \(3,\)"):
        x + jnp.ones(3)
    with pytest.raises(TypeError, match=r"__rmul__: cannot combine a NamedArray with an unnamed array of shape"):
        np.ones(3) * x
    with pytest.raises(TypeError, match=r"__lt__: cannot combine a NamedArray with an unnamed array"):
        _ = x < np.zeros((3,))
    # A 0-d array has no axes to confuse: it broadcasts like a scalar.
    assert ((x + jnp.float32(1)).array == 2).all()


def test_elementwise_applies_a_positional_function_by_name():
    a, b = nt.Axis("a", 2), nt.Axis("b", 3)
    x = nt.named(jnp.arange(2.0), (a,))
    y = nt.named(jnp.arange(3.0), (b,))
    out = nt.elementwise(jnp.arctan2, y, x)
    assert out.axis_names == ("b", "a")
    np.testing.assert_allclose(np.asarray(out.array), np.arctan2(np.arange(3.0)[:, None], np.arange(2.0)))
    with pytest.raises(TypeError, match="arctan2 needs at least one NamedArray among its arguments"):
        nt.elementwise(jnp.arctan2, 1.0, 2.0)


# -- permute, rename, broadcast ---------------------------------------------------------------------------


@FAST
@given(arrays=named_arrays(count=1), data=st.data())
def test_permute_matches_numpy_transpose(arrays, data):
    (x,) = arrays
    order = data.draw(st.permutations(x.axis_names))
    out = nt.permute(x, order)
    assert out.axis_names == tuple(order)
    np.testing.assert_array_equal(
        np.asarray(out.array), np.transpose(np.asarray(x.array), [x.axis_names.index(n) for n in order])
    )
    if order:
        rest_last = x.permute(order[0], ...)
        assert rest_last.axis_names == (order[0], *[n for n in x.axis_names if n != order[0]])
        first_last = x.permute(..., order[0])
        assert first_last.axis_names == (*[n for n in x.axis_names if n != order[0]], order[0])


def test_permute_errors():
    x = nt.zeros((nt.Axis("a", 2), nt.Axis("b", 3)))
    with pytest.raises(ValueError, match=r"permute must name every axis \(or use ...\); missing \['b'\]"):
        nt.permute(x, ["a"])
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['a'\]"):
        nt.permute(x, ["a", "a"])
    with pytest.raises(ValueError, match="Unknown axis 'z'"):
        nt.permute(x, ["a", "z"])


def test_rename_keeps_data_and_sizes():
    x = nt.named(jnp.arange(6).reshape(2, 3), ("a", "b"))
    y = x.rename({"a": "batch", nt.Axis("b", 3): nt.Axis("embed", 3)})
    assert y.axes == (nt.Axis("batch", 2), nt.Axis("embed", 3))
    assert (y.array == x.array).all()
    with pytest.raises(ValueError, match=r"Unknown axis 'z': this array has axes \(a=2, b=3\)"):
        nt.rename(x, {"z": "y"})
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['b'\]"):
        nt.rename(x, {"a": "b"})


@FAST
@given(arrays=named_arrays(count=2))
def test_broadcast_to_and_broadcast_arrays_match_numpy(arrays):
    x, y = arrays
    target_names = union_names(x, y)
    target = [nt.Axis(n, (x.shape | y.shape)[n]) for n in target_names]
    out = nt.broadcast_to(x, target)
    assert out.axes == tuple(target)
    ref = np.broadcast_to(aligned(np, np.asarray(x.array), x.axis_names, target_names), [a.size for a in target])
    np.testing.assert_array_equal(np.asarray(out.array), ref)
    bx, by = nt.broadcast_arrays(x, y)
    assert bx.axes == by.axes == nt.union_axes(x.axes, y.axes)
    np.testing.assert_array_equal(np.asarray(nt.permute(bx, target_names).array), ref)


def test_broadcast_to_options_and_errors():
    a, b = nt.Axis("a", 2), nt.Axis("b", 3)
    x = nt.named(jnp.arange(2.0), (a,))
    assert nt.broadcast_to(x, (a,)) is x
    kept = nt.broadcast_to(x, (b,), enforce_no_extra=False)
    assert kept.axis_names == ("a", "b")
    assert nt.broadcast_to(1.5, (a, b)).axes == (a, b)
    with pytest.raises(ValueError, match=r"axes \['a'\] are not in the target"):
        nt.broadcast_to(x, (b,))
    with pytest.raises(TypeError, match="broadcast_to needs Axis objects \\(with sizes\\), got 'b'"):
        nt.broadcast_to(x, ("b",))
    with pytest.raises(ValueError, match="Axis 'a' has size 5 in one array and 2 in another"):
        nt.broadcast_to(x, (nt.Axis("a", 5),))
    assert nt.broadcast_arrays(1, 2.0) == (1, 2.0)


def test_union_axes_keeps_first_seen_order_and_checks_sizes():
    a, b, c = nt.Axis("a", 1), nt.Axis("b", 2), nt.Axis("c", 3)
    assert nt.union_axes((b, a), (c, a)) == (b, a, c)
    with pytest.raises(ValueError, match="Axis 'b' has size 2 in one array and 5 in another"):
        nt.union_axes((b,), (nt.Axis("b", 5),))


# -- dot ----------------------------------------------------------------------------------------------------


@FAST
@given(arrays=named_arrays(count=3), data=st.data())
def test_dot_matches_einsum(arrays, data):
    names = union_names(*arrays)
    contracted = data.draw(st.lists(st.sampled_from(names), unique=True) if names else st.just([]))
    letter = dict(zip(NAMES, string.ascii_lowercase, strict=False))
    kept = [n for n in names if n not in contracted]
    spec = ",".join("".join(letter[n] for n in a.axis_names) for a in arrays)
    spec += "->" + "".join(letter[n] for n in kept)
    ref = np.einsum(spec, *[np.asarray(a.array, np.float64) for a in arrays])
    out = nt.dot(*arrays, axis=contracted)
    assert out.axis_names == tuple(kept)
    np.testing.assert_allclose(np.asarray(out.array), ref, rtol=1e-4, atol=1e-4)
    total = nt.dot(*arrays, axis=None)
    assert total.axes == ()
    np.testing.assert_allclose(np.asarray(total.array), ref.sum(), rtol=1e-4, atol=1e-4)


def test_dot_errors():
    x = nt.ones((nt.Axis("a", 2), nt.Axis("b", 3)))
    with pytest.raises(ValueError, match="dot needs at least one array"):
        nt.dot(axis=None)
    with pytest.raises(TypeError, match="dot takes NamedArrays, got ArrayImpl"):
        nt.dot(x, jnp.ones(3), axis="b")
    with pytest.raises(ValueError, match=r"dot: unknown axis 'z'; the arrays have axes \(a=2, b=3\)"):
        nt.dot(x, x, axis="z")
    with pytest.raises(ValueError, match="Axis 'b' has size 3 in one array and 4 in another"):
        nt.dot(x, x, axis=nt.Axis("b", 4))
    with pytest.raises(ValueError, match="Axis 'b' has size 3 in one array and 4 in another"):
        nt.dot(x, nt.ones(nt.Axis("b", 4)), axis="b")


# -- pytree: jit, grad, vmap, scan, equinox ----------------------------------------------------------------


def test_namedarray_is_a_pytree_of_one_leaf():
    x = nt.named(jnp.arange(6.0).reshape(2, 3), ("a", "b"))
    leaves, treedef = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 1 and leaves[0] is x.array
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back.axes == x.axes
    doubled = jax.tree.map(lambda v: v * 2, x)
    assert isinstance(doubled, nt.NamedArray) and doubled.axes == x.axes


@FEW
@given(arrays=named_arrays(count=2))
def test_jit_and_grad_through_broadcasting_and_dot(arrays):
    x, y = arrays
    target = union_names(x, y)

    def loss(x, y):
        return nt.sum(nt.tanh(x * y + x)).scalar()

    def ref_loss(xa, ya):
        xb, yb = aligned(jnp, xa, x.axis_names, target), aligned(jnp, ya, y.axis_names, target)
        return jnp.sum(jnp.tanh(xb * yb + xb))

    jitted = jax.jit(lambda x, y: x * y + x)(x, y)
    assert isinstance(jitted, nt.NamedArray) and jitted.axis_names == tuple(target)
    np.testing.assert_allclose(np.asarray(jitted.array), np.asarray((x * y + x).array), rtol=1e-5, atol=1e-6)

    gx, gy = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, y)
    rx, ry = jax.grad(ref_loss, argnums=(0, 1))(x.array, y.array)
    assert gx.axes == x.axes and gy.axes == y.axes
    # The gradient of a broadcast operand sums over the axes it lacks; jit may sum in another order, and where
    # the terms cancel that differs by a few ulps of the terms (seen: 2e-6 on a gradient entry of 3e-4).
    np.testing.assert_allclose(np.asarray(gx.array), np.asarray(rx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gy.array), np.asarray(ry), rtol=1e-5, atol=1e-5)


def test_vmap_and_scan_carry_namedarrays():
    a = nt.Axis("a", 3)
    x = nt.named(jnp.arange(3.0), (a,))
    scales = jnp.arange(4.0)
    by_vmap = jax.vmap(lambda s, x: nt.sum(x * s).scalar(), in_axes=(0, None))(scales, x)
    np.testing.assert_allclose(np.asarray(by_vmap), np.arange(4.0) * 3.0)

    def step(carry, s):
        new = carry * s + 1.0
        return new, nt.sum(new).scalar()

    final, sums = jax.lax.scan(step, x, scales)
    ref = np.arange(3.0)
    ref_sums = []
    for s in range(4):
        ref = ref * s + 1
        ref_sums.append(ref.sum())
    assert isinstance(final, nt.NamedArray) and final.axes == (a,)
    np.testing.assert_allclose(np.asarray(final.array), ref)
    np.testing.assert_allclose(np.asarray(sums), ref_sums)


class _Linear(eqx.Module):
    weight: nt.NamedArray
    bias: nt.NamedArray

    def __call__(self, x: nt.NamedArray) -> nt.NamedArray:
        return nt.dot(x, self.weight, axis="embed") + self.bias


def test_namedarrays_inside_equinox_modules_under_filter_jit_and_grad():
    batch, embed, out = nt.Axis("batch", 4), nt.Axis("embed", 3), nt.Axis("out", 2)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    model = _Linear(nt.random.normal(k1, (out, embed)), nt.random.normal(k2, (out,)))
    x = nt.random.normal(k3, (batch, embed))

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(model, x):
        return nt.sum(nt.square(model(x))).scalar()

    g = grads(model, x)
    assert isinstance(g, _Linear) and g.weight.axes == (out, embed) and g.bias.axes == (out,)

    def ref(w, b, xa):
        return jnp.sum(jnp.square(xa @ w.T + b[None, :]))

    rw, rb = jax.grad(ref, argnums=(0, 1))(model.weight.array, model.bias.array, x.array)
    np.testing.assert_allclose(np.asarray(g.weight.array), np.asarray(rw), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g.bias.array), np.asarray(rb), rtol=1e-5)
    y = eqx.filter_jit(model)(x)
    assert y.axis_names == ("batch", "out")
