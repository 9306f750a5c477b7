"""Indexing by name, gathers, dynamic slices and the ops along one axis, against numpy and jax.lax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import named_tensors as nt

FEW = settings(max_examples=12, deadline=None)
NAMES = ("a", "b", "c")


@st.composite
def arrays_and_axis(draw, min_size=1):
    """A random float32 NamedArray (1-3 axes in random order) and one of its axis names."""
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, min_size=1, max_size=3))
    sizes = [draw(st.integers(min_size, 5)) for _ in names]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = nt.named(jnp.asarray(rng.standard_normal(sizes).astype(np.float32)), names)
    return x, draw(st.sampled_from(names))


def along(x, name):
    return x.axis_names.index(name)


def check(result, ref, names):
    assert result.axis_names == tuple(names)
    np.testing.assert_array_equal(np.asarray(result.array), np.asarray(ref))


# -- static indexing ----------------------------------------------------------------------------------------


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_slices_keep_the_axis_and_resize_it(case, data):
    x, name = case
    n = x.axis_size(name)
    sl = slice(
        data.draw(st.none() | st.integers(-n - 1, n + 1)),
        data.draw(st.none() | st.integers(-n - 1, n + 1)),
        data.draw(st.none() | st.sampled_from([1, 2, -1, 3])),
    )
    out = x[name, sl]
    pos = along(x, name)
    ref = np.asarray(x.array)[(slice(None),) * pos + (sl,)]
    check(out, ref, x.axis_names)
    assert out.axis_size(name) == ref.shape[pos]


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_an_integer_drops_its_axis(case, data):
    x, name = case
    n = x.axis_size(name)
    i = data.draw(st.integers(-n, n - 1))
    kept = [m for m in x.axis_names if m != name]
    check(x[name, i], np.take(np.asarray(x.array), i, axis=along(x, name)), kept)
    check(x[nt.Axis(name, n), np.int64(i)], np.take(np.asarray(x.array), i, axis=along(x, name)), kept)


def test_several_axes_at_once_by_pairs_or_dict():
    x = nt.named(jnp.arange(60.0).reshape(3, 4, 5), ("batch", "position", "embed"))
    ref = np.arange(60.0).reshape(3, 4, 5)
    check(x["batch", 1, "position", 1:3], ref[1, 1:3], ("position", "embed"))
    check(x[{"batch": 0, "embed": slice(2, 5)}], ref[0, :, 2:5], ("position", "embed"))
    check(x[{"embed": -1, "batch": 2}], ref[2, :, -1], ("position",))
    check(x[{}], ref, x.axis_names)


def test_take_matches_getitem_and_numpy():
    x = nt.named(jnp.arange(12.0).reshape(3, 4), ("a", "b"))
    k = nt.Axis("k", 3)
    idx = nt.named(jnp.array([3, 0, 3]), (k,))
    check(nt.take(x, "b", idx), np.take(np.arange(12.0).reshape(3, 4), [3, 0, 3], axis=1), ("a", "k"))
    check(nt.take(x, "a", 2), np.arange(12.0).reshape(3, 4)[2], ("b",))


# -- gathers with NamedArray indices ------------------------------------------------------------------------


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_a_named_index_replaces_the_axis_with_its_own(case, data):
    x, name = case
    n = x.axis_size(name)
    count = data.draw(st.integers(0, 4))
    values = data.draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count))
    idx = nt.named(jnp.asarray(values, jnp.int32), ("picked",))
    out = x[name, idx]
    pos = along(x, name)
    expected_names = [*x.axis_names[:pos], "picked", *x.axis_names[pos + 1 :]]
    check(out, np.take(np.asarray(x.array), np.asarray(values, np.int64), axis=pos), expected_names)


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_index_axes_shared_with_the_array_are_matched_elementwise(case, data):
    x, name = case
    n = x.axis_size(name)
    others = [a for a in x.axes if a.name != name]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    order = data.draw(st.permutations(others))
    targets = rng.integers(0, n, size=[a.size for a in order]).astype(np.int32)
    idx = nt.named(jnp.asarray(targets), order)
    out = x[name, idx]
    # reference: put `name` last, lay the targets out like the other axes, take_along_axis
    moved = np.moveaxis(np.asarray(x.array), along(x, name), -1)
    other_names = [a.name for a in others]
    laid = np.transpose(targets, [[a.name for a in order].index(m) for m in other_names])
    ref = np.take_along_axis(moved, laid[..., None], axis=-1)[..., 0]
    check(out, ref, other_names)


def test_gather_picks_targets_under_jit_and_grad():
    batch, pos, vocab = nt.Axis("batch", 2), nt.Axis("position", 3), nt.Axis("vocab", 5)
    logits = nt.random.normal(jax.random.key(0), (batch, vocab, pos))
    targets = nt.random.randint(jax.random.key(1), (pos, batch), 0, 5)

    def picked_sum(logits):
        return nt.sum(nt.log_softmax(logits, "vocab")["vocab", targets]).scalar()

    def ref(arr):  # arr laid out (batch, vocab, position); targets (position, batch)
        lsm = jax.nn.log_softmax(arr, axis=1)
        return jnp.sum(jnp.take_along_axis(lsm, targets.array.T[:, None, :], axis=1))

    value, grad = jax.jit(jax.value_and_grad(picked_sum))(logits)
    ref_value, ref_grad = jax.value_and_grad(ref)(logits.array)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    assert grad.axes == logits.axes
    np.testing.assert_allclose(np.asarray(grad.array), np.asarray(ref_grad), rtol=1e-5, atol=1e-6)


def test_several_named_indices_are_broadcast_together_by_name():
    x = nt.named(jnp.arange(60.0).reshape(3, 4, 5), ("a", "b", "c"))
    ref = np.arange(60.0).reshape(3, 4, 5)
    ia = nt.named(jnp.array([0, 2]), ("k",))
    ic = nt.named(jnp.array([[1, 4], [0, 0], [3, 2]]), ("m", "k"))
    out = x[{"a": ia, "c": ic}]
    # new axes take the place of the first indexed axis ("a"); "b" keeps its place after them
    assert out.axis_names == ("k", "m", "b")
    expected = np.empty((2, 3, 4))
    for k in range(2):
        for m in range(3):
            expected[k, m] = ref[[0, 2][k], :, np.asarray(ic.array)[m, k]]
    np.testing.assert_array_equal(np.asarray(out.array), expected)
    # an int index mixed with a named one
    check(x[{"a": 1, "c": ia}], ref[1][:, [0, 2]].T, ("k", "b"))


def test_scalar_indices_may_be_traced():
    x = nt.named(jnp.arange(12.0).reshape(3, 4), ("a", "b"))
    ref = np.arange(12.0).reshape(3, 4)

    @jax.jit
    def pick(i, j):
        return x[{"a": i, "b": nt.named(j, ())}]

    out = pick(jnp.int32(2), jnp.int32(1))
    assert out.axes == ()
    assert float(out.array) == ref[2, 1]
    row = jax.jit(lambda i: x["a", i])(jnp.int32(1))
    check(row, ref[1], ("b",))


# -- dynamic slices -----------------------------------------------------------------------------------------


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_dynamic_slices_match_lax_under_jit(case, data):
    x, name = case
    n = x.axis_size(name)
    size = data.draw(st.integers(0, n))
    start = data.draw(st.integers(-2, n + 2))  # lax clamps the start so the slice stays inside
    pos = along(x, name)
    ref = jax.lax.dynamic_slice_in_dim(x.array, start, size, axis=pos)
    by_ds = jax.jit(lambda x, s: x[name, nt.ds(s, size)])(x, jnp.int32(start))
    check(by_ds, ref, x.axis_names)
    assert by_ds.axis_size(name) == size
    by_fn = jax.jit(lambda x, s: nt.dynamic_slice(x, {name: s}, {name: size}))(x, jnp.int32(start))
    check(by_fn, ref, x.axis_names)


def test_dynamic_update_slice_matches_lax():
    x = nt.named(jnp.zeros((3, 6)), ("batch", "position"))
    update = nt.named(jnp.arange(6.0).reshape(2, 3), ("position", "batch"))
    out = jax.jit(lambda x, u, s: nt.dynamic_update_slice(x, u, {"position": s}))(x, update, jnp.int32(3))
    ref = jax.lax.dynamic_update_slice(jnp.zeros((3, 6)), jnp.arange(6.0).reshape(2, 3).T, (0, 3))
    check(out, ref, ("batch", "position"))
    # an axis that the update lacks is written whole; the update is cast to x's dtype
    row = nt.named(jnp.array([7, 8], jnp.int32), ("position",))
    filled = nt.dynamic_update_slice(x, row, {"position": 1})
    expected = np.zeros((3, 6))
    expected[:, 1:3] = [7.0, 8.0]
    check(filled, expected, ("batch", "position"))
    assert filled.dtype == jnp.float32


def test_dynamic_update_slice_gradient_flows_to_both_inputs():
    x = nt.named(jnp.arange(6.0), ("position",))
    u = nt.named(jnp.array([10.0, 20.0]), ("position",))

    def f(x, u):
        return nt.sum(nt.dynamic_update_slice(x, u, {"position": 2}) * nt.arange(x.axes[0]).astype(jnp.float32))

    gx, gu = jax.grad(lambda x, u: f(x, u).scalar(), argnums=(0, 1))(x, u)
    np.testing.assert_array_equal(np.asarray(gx.array), [0, 1, 0, 0, 4, 5])
    np.testing.assert_array_equal(np.asarray(gu.array), [2, 3])


# -- pad, roll, top_k, cumsum, sort -------------------------------------------------------------------------


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_pad_and_roll_match_numpy(case, data):
    x, name = case
    pos = along(x, name)
    before, after = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    widths = [(0, 0)] * x.ndim
    widths[pos] = (before, after)
    arr = np.asarray(x.array)
    check(nt.pad(x, {name: (before, after)}), np.pad(arr, widths), x.axis_names)
    check(
        nt.pad(x, {name: (before, after)}, constant_values=-1.0),
        np.pad(arr, widths, constant_values=-1.0),
        x.axis_names,
    )
    check(nt.pad(x, {name: (before, after)}, mode="edge"), np.pad(arr, widths, mode="edge"), x.axis_names)
    both = [(0, 0)] * x.ndim
    both[pos] = (before, before)
    check(nt.pad(x, {name: before}), np.pad(arr, both), x.axis_names)
    shift = data.draw(st.integers(-6, 6))
    check(nt.roll(x, shift, name), np.roll(arr, shift, axis=pos), x.axis_names)
    all_axes = list(x.axis_names)
    shifts = [shift + i for i in range(len(all_axes))]
    check(nt.roll(x, shifts, all_axes), np.roll(arr, shifts, axis=tuple(range(x.ndim))), x.axis_names)


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_top_k_matches_lax_along_the_named_axis(case, data):
    x, name = case
    n = x.axis_size(name)
    k = data.draw(st.integers(0, n))
    pos = along(x, name)
    ref_values, ref_indices = jax.lax.top_k(jnp.moveaxis(x.array, pos, -1), k)
    values, indices = nt.top_k(x, name, k)
    check(values, jnp.moveaxis(ref_values, -1, pos), x.axis_names)
    check(indices, jnp.moveaxis(ref_indices, -1, pos), x.axis_names)
    assert values.axis_size(name) == k
    renamed, _ = nt.top_k(x, name, k, new_axis="top")
    assert renamed.axis_names == tuple("top" if m == name else m for m in x.axis_names)
    assert renamed.axis_size("top") == k
    # gathering x at the indices (the other axes matched by name) gives back the values
    check(x[name, indices], values.array, x.axis_names)


@FEW
@given(case=arrays_and_axis(), reverse=st.booleans())
def test_cumsum_and_cumprod_match_numpy(case, reverse):
    x, name = case
    pos = along(x, name)
    arr = np.asarray(x.array, np.float64)
    if reverse:
        ref_sum = np.flip(np.cumsum(np.flip(arr, pos), axis=pos), pos)
        ref_prod = np.flip(np.cumprod(np.flip(arr, pos), axis=pos), pos)
    else:
        ref_sum, ref_prod = np.cumsum(arr, axis=pos), np.cumprod(arr, axis=pos)
    out = nt.cumsum(x, name, reverse=reverse)
    assert out.axes == x.axes
    np.testing.assert_allclose(np.asarray(out.array), ref_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(nt.cumprod(x, name, reverse=reverse).array), ref_prod, rtol=1e-5, atol=1e-6)
    as_int = nt.cumsum(x > 0, name, dtype=jnp.int32)
    assert as_int.dtype == jnp.int32


@FEW
@given(case=arrays_and_axis(), descending=st.booleans())
def test_sort_and_argsort_match_numpy(case, descending):
    x, name = case
    pos = along(x, name)
    arr = np.round(np.asarray(x.array), 1)  # rounding makes ties, which a stable argsort keeps in order
    x = nt.NamedArray(jnp.asarray(arr), x.axes)
    sorted_ref = np.sort(arr, axis=pos)
    order_ref = np.argsort(arr, axis=pos, kind="stable")
    if descending:
        sorted_ref = np.flip(sorted_ref, pos)
        order_ref = np.argsort(-arr, axis=pos, kind="stable")
    check(nt.sort(x, name, descending=descending), sorted_ref, x.axis_names)
    check(nt.argsort(x, name, descending=descending), order_ref, x.axis_names)


def test_ops_along_an_axis_under_grad():
    x = nt.named(jnp.array([[3.0, 1.0, 2.0], [0.5, 4.0, -1.0]]), ("a", "b"))

    def f(x):
        values, _ = nt.top_k(x, "b", 2)
        weights = nt.arange(x.axes[1]).astype(jnp.float32)
        return nt.sum(values * 2.0) + nt.sum(nt.cumsum(x, "b")) + nt.sum(nt.sort(x, "b") * weights)

    def ref(arr):
        values, _ = jax.lax.top_k(arr, 2)
        return (
            jnp.sum(values * 2.0)
            + jnp.sum(jnp.cumsum(arr, axis=1))
            + jnp.sum(jnp.sort(arr, axis=1) * jnp.arange(3.0)[None, :])
        )

    g = jax.jit(jax.grad(lambda x: f(x).scalar()))(x)
    np.testing.assert_allclose(np.asarray(g.array), np.asarray(jax.grad(ref)(x.array)), rtol=1e-6)


# -- errors -------------------------------------------------------------------------------------------------


def test_indexing_errors_name_the_axes():
    x = nt.named(jnp.zeros((2, 3)), ("a", "b"))
    with pytest.raises(ValueError, match=r"Unknown axis 'z': this array has axes \(a=2, b=3\)"):
        x["z", 0]
    with pytest.raises(TypeError, match=r"A NamedArray is indexed by name, as x\['axis', index\]"):
        x[0]
    with pytest.raises(TypeError, match=r"indexed by name.*got 'a'"):
        x["a"]
    with pytest.raises(TypeError, match=r"indexed by name.*got \(0, 1\)"):
        x[0, 1]
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['a'\]"):
        x[{"a": 0, nt.Axis("a", 2): 1}]
    with pytest.raises(IndexError, match="Index 3 is out of range for axis 'b' of size 3"):
        x["b", 3]
    with pytest.raises(IndexError, match="Index -3 is out of range for axis 'a' of size 2"):
        x["a", -3]
    with pytest.raises(
        TypeError, match=r"Index for axis 'b' must be an int, a slice, nt.ds\(start, size\) or an integer"
    ):
        x["b", 1.5]
    with pytest.raises(TypeError, match=r"Index for axis 'b' must be .* got ArrayImpl of shape \(2,\): name its axes"):
        x["b", jnp.array([0, 1])]
    with pytest.raises(TypeError, match=r"Index for axis 'b' must be .* got bool"):
        x["b", True]
    with pytest.raises(TypeError, match="Index for axis 'a' must hold integers, got dtype bool"):
        x["a", x["b", 0] > 0]
    with pytest.raises(
        ValueError,
        match=r"The index for axis \['b'\] has axis 'a' of size 4, but the indexed array's 'a' has size 2",
    ):
        x["b", nt.zeros(nt.Axis("a", 4), dtype=jnp.int32)]
    two = {"a": nt.zeros(nt.Axis("k", 2), dtype=jnp.int32), "b": nt.zeros(nt.Axis("k", 3), dtype=jnp.int32)}
    with pytest.raises(ValueError, match="Axis 'k' has size 2 in one array and 3 in another"):
        x[two]
    with pytest.raises(ValueError, match="Dynamic slice of size 4 is longer than axis 'b'=3"):
        x["b", nt.ds(0, 4)]
    with pytest.raises(TypeError, match="ds needs a static non-negative int size, got -1"):
        nt.ds(0, -1)
    with pytest.raises(TypeError, match=r"ds needs a static non-negative int size, got 2.0"):
        nt.ds(0, 2.0)
    with pytest.raises(TypeError, match="index takes a NamedArray, got ArrayImpl"):
        nt.index(jnp.zeros(3), {"a": 0})


def test_errors_of_the_ops_along_an_axis():
    x = nt.named(jnp.zeros((2, 3)), ("a", "b"))
    with pytest.raises(
        ValueError,
        match=r"dynamic_slice needs a start and a size for the same axes; "
        r"got starts for \['a'\] and sizes for \['b'\]",
    ):
        nt.dynamic_slice(x, {"a": 0}, {"b": 1})
    with pytest.raises(
        ValueError, match=r"dynamic_update_slice: update has axes \['c'\] that x \(a=2, b=3\) does not have"
    ):
        nt.dynamic_update_slice(x, nt.zeros(nt.Axis("c", 1)), {})
    with pytest.raises(ValueError, match="dynamic_update_slice: update's axis 'b'=4 is longer than x's 'b'=3"):
        nt.dynamic_update_slice(x, nt.zeros(nt.Axis("b", 4)), {})
    with pytest.raises(ValueError, match=r"Unknown axis 'z'"):
        nt.dynamic_update_slice(x, nt.zeros(nt.Axis("b", 1)), {"z": 0})
    with pytest.raises(ValueError, match=r"pad widths must be non-negative, got \(-1, 0\) for axis 'a'"):
        nt.pad(x, {"a": (-1, 0)})
    with pytest.raises(ValueError, match=r"Unknown axis 'z'"):
        nt.pad(x, {"z": 1})
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['a'\]"):
        nt.roll(x, 1, ["a", "a"])
    with pytest.raises(ValueError, match="top_k: k=4 must be between 0 and the size of axis 'b'=3"):
        nt.top_k(x, "b", 4)
    with pytest.raises(ValueError, match=r"top_k: new axis Axis\('top', 3\) must have size k=2"):
        nt.top_k(x, "b", 2, new_axis=nt.Axis("top", 3))
    for fn in (nt.cumsum, nt.cumprod, nt.sort, nt.argsort):
        with pytest.raises(ValueError, match=r"Unknown axis 'z': this array has axes \(a=2, b=3\)"):
            fn(x, "z")


# -- functional updates: x.at[...] --------------------------------------------------------------------------


@FEW
@given(case=arrays_and_axis(), data=st.data())
def test_at_updates_match_jnp_at_on_the_same_positions(case, data):
    x, name = case
    n = x.axis_size(name)
    pos = along(x, name)
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo, n))
    sl = slice(lo, hi)
    selected = x[name, sl]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # values over the selection's axes, given in another order
    order = data.draw(st.permutations(selected.axis_names))
    raw = jnp.asarray(rng.standard_normal(list(selected.array.shape)), jnp.float32)
    values = nt.permute(nt.named(raw, selected.axes), order)
    values_laid_out = nt.permute(values, selected.axis_names).array
    where = (slice(None),) * pos + (sl,)
    for method in ("set", "add", "multiply", "min", "max"):
        out = getattr(x.at[name, sl], method)(values)
        ref = getattr(x.array.at[where], method)(values_laid_out)
        check(out, ref, x.axis_names)
    check(x.at[name, sl].set(2.5), x.array.at[where].set(2.5), x.axis_names)
    check(x.at[name, sl].get(), selected.array, x.axis_names)


def test_at_with_named_indices_accumulates_repeats_and_broadcasts_values_by_name():
    x = nt.named(jnp.zeros((2, 5)), ("batch", "vocab"))
    idx = nt.named(jnp.array([1, 1, 4]), ("k",))
    values = nt.named(jnp.array([1.0, 2.0, 3.0]), ("k",))  # no batch axis: the same for every row
    out = x.at["vocab", idx].add(values)
    check(out, np.tile([0.0, 3.0, 0.0, 0.0, 3.0], (2, 1)), ("batch", "vocab"))
    # per-row targets matched along batch: one-hot rows
    targets = nt.named(jnp.array([3, 0]), ("batch",))
    check(x.at["vocab", targets].set(1.0), np.eye(5)[[3, 0]], ("batch", "vocab"))
    check(x.at[{"batch": 1, "vocab": 2}].add(7.0), [[0.0, 0, 0, 0, 0], [0, 0, 7, 0, 0]], ("batch", "vocab"))


def test_at_with_a_traced_dynamic_slice_under_jit_and_grad():
    cache = nt.named(jnp.zeros((2, 6)), ("batch", "position"))
    new = nt.named(jnp.array([[1.0, 2.0], [3.0, 4.0]]), ("position", "batch"))

    @jax.jit
    def write(cache, new, start):
        return cache.at["position", nt.ds(start, 2)].set(new)

    out = write(cache, new, jnp.int32(3))
    check(out, jax.lax.dynamic_update_slice(jnp.zeros((2, 6)), new.array.T, (0, 3)), ("batch", "position"))

    def f(cache, new):
        return nt.sum(write(cache, new, jnp.int32(1)) * nt.arange(cache.axes[1]).astype(jnp.float32)).scalar()

    g_cache, g_new = jax.grad(f, argnums=(0, 1))(cache, new)
    np.testing.assert_array_equal(np.asarray(g_cache.array), np.tile([0.0, 0, 0, 3, 4, 5], (2, 1)))
    assert g_new.axes == new.axes
    np.testing.assert_array_equal(np.asarray(g_new.array), [[1.0, 1.0], [2.0, 2.0]])


def test_at_errors_name_the_axes():
    x = nt.named(jnp.zeros((2, 3)), ("a", "b"))
    with pytest.raises(ValueError, match=r"x.at\[...\].set: values have axes \['c'\] that the selection \(a=2, b=2\)"):
        x.at["b", 0:2].set(nt.zeros(nt.Axis("c", 2)))
    with pytest.raises(
        TypeError,
        match=r"x.at\[...\].add: values must be a scalar or a NamedArray, got an unnamed array of shape \(2,\)",
    ):
        x.at["a", 0:2].add(jnp.ones(2))
    with pytest.raises(ValueError, match=r"Unknown axis 'z'"):
        x.at["z", 0].set(1.0)
    with pytest.raises(TypeError, match=r"A NamedArray is indexed by name"):
        x.at[0].set(1.0)
