"""nt.random: each draw equals jax.random on the positional shape of the axes, in their given order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import named_tensors as nt

# Each new shape compiles every sampler again (slow on CPU): few examples, few distinct sizes.
FEW = settings(max_examples=6, deadline=None)


@st.composite
def keys_and_axes(draw, min_axes=0):
    names = draw(st.lists(st.sampled_from(("a", "b", "c")), unique=True, min_size=min_axes, max_size=3))
    axes = tuple(nt.Axis(n, draw(st.sampled_from((1, 3)))) for n in names)
    return jax.random.key(draw(st.integers(0, 2**31 - 1))), axes


def shape(axes):
    return tuple(a.size for a in axes)


def same(named_result, positional):
    np.testing.assert_array_equal(np.asarray(named_result.array), np.asarray(positional))


@FEW
@given(case=keys_and_axes())
def test_draws_equal_jax_random_on_the_positional_shape(case):
    key, axes = case
    s = shape(axes)
    draws = {
        "normal": (nt.random.normal(key, axes), jax.random.normal(key, s)),
        "normal_bf16": (
            nt.random.normal(key, axes, dtype=jnp.bfloat16),
            jax.random.normal(key, s, jnp.bfloat16),
        ),
        "uniform": (
            nt.random.uniform(key, axes, minval=-2.0, maxval=3.0),
            jax.random.uniform(key, s, minval=-2.0, maxval=3.0),
        ),
        "randint": (nt.random.randint(key, axes, 3, 9), jax.random.randint(key, s, 3, 9)),
        "truncated_normal": (
            nt.random.truncated_normal(key, axes, -1.0, 1.5),
            jax.random.truncated_normal(key, -1.0, 1.5, s),
        ),
        "bernoulli": (nt.random.bernoulli(key, axes, 0.3), jax.random.bernoulli(key, 0.3, s)),
    }
    for name, (named_result, positional) in draws.items():
        assert named_result.axes == axes, name
        assert named_result.dtype == positional.dtype, name
        same(named_result, positional)
    assert bool(nt.all((draws["uniform"][0] >= -2.0) & (draws["uniform"][0] < 3.0)).array)
    assert bool(nt.all((draws["randint"][0] >= 3) & (draws["randint"][0] < 9)).array)
    tn = draws["truncated_normal"][0]
    assert bool(nt.all((tn >= -1.0) & (tn <= 1.5)).array)


def test_same_key_same_bits_other_key_other_bits():
    axes = (nt.Axis("batch", 4), nt.Axis("embed", 8))
    first = nt.random.normal(jax.random.key(7), axes)
    again = nt.random.normal(jax.random.key(7), axes)
    other = nt.random.normal(jax.random.key(8), axes)
    np.testing.assert_array_equal(np.asarray(first.array), np.asarray(again.array))
    assert not np.array_equal(np.asarray(first.array), np.asarray(other.array))


def test_bounds_and_probabilities_broadcast_by_name():
    batch, embed = nt.Axis("batch", 3), nt.Axis("embed", 500)
    key = jax.random.key(0)
    lo = nt.named(jnp.array([0.0, 10.0, -5.0]), (batch,))
    out = nt.random.uniform(key, (embed, batch), minval=lo, maxval=lo + 1.0)
    ref = jax.random.uniform(key, (500, 3), minval=lo.array[None, :], maxval=lo.array[None, :] + 1.0)
    same(out, ref)
    assert bool(nt.all((out >= lo) & (out < lo + 1.0)).array)

    p = nt.named(jnp.array([0.0, 1.0, 0.5]), (batch,))
    coins = nt.random.bernoulli(key, (embed, batch), p)
    same(coins, jax.random.bernoulli(key, jnp.broadcast_to(p.array[None, :], (500, 3)), (500, 3)))
    per_row = nt.mean(coins.astype(jnp.float32), "embed").array
    assert per_row[0] == 0.0 and per_row[1] == 1.0 and 0.4 < per_row[2] < 0.6

    low = nt.named(jnp.array([-1.0, 0.0, 1.0]), (batch,))
    cut = nt.random.truncated_normal(key, (batch, embed), lower=low, upper=low + 0.5)
    assert bool(nt.all((cut >= low) & (cut <= low + 0.5)).array)

    ints = nt.random.randint(key, (embed, batch), nt.named(jnp.array([0, 5, 10]), (batch,)), 12)
    assert bool(nt.all(ints >= nt.named(jnp.array([0, 5, 10]), (batch,))).array)


@FEW
@given(case=keys_and_axes(min_axes=1), data=st.data())
def test_categorical_equals_jax_over_the_named_axis(case, data):
    key, axes = case
    choice = data.draw(st.sampled_from(axes))
    logits = nt.random.normal(jax.random.fold_in(key, 1), axes)
    out = nt.random.categorical(key, logits, choice.name)
    others = tuple(a for a in axes if a != choice)
    assert out.axes == others
    laid_out = nt.permute(logits, [*[a.name for a in others], choice.name]).array
    same(out, jax.random.categorical(key, laid_out, axis=-1))
    assert bool(nt.all((out >= 0) & (out < choice.size)).array)


def test_categorical_with_extra_sample_axes_follows_the_logits():
    batch, vocab, sample = nt.Axis("batch", 2), nt.Axis("vocab", 4), nt.Axis("sample", 50)
    # Row 0 always picks vocab 3, row 1 always vocab 1.
    logits = nt.named(jnp.array([[-1e9, -1e9, -1e9, 0.0], [-1e9, 0.0, -1e9, -1e9]]), (batch, vocab))
    out = nt.random.categorical(jax.random.key(3), logits, "vocab", axes=(sample, batch))
    assert out.axes == (sample, batch)
    np.testing.assert_array_equal(np.asarray(out.array), np.tile([3, 1], (50, 1)))


def test_permutation_of_an_axis_and_of_an_array():
    key = jax.random.key(5)
    pos = nt.Axis("position", 10)
    shuffled = nt.random.permutation(key, pos)
    assert shuffled.axes == (pos,)
    same(shuffled, jax.random.permutation(key, 10))
    assert sorted(np.asarray(shuffled.array).tolist()) == list(range(10))

    x = nt.named(jnp.arange(30).reshape(3, 10), ("batch", "position"))
    rows = nt.random.permutation(key, x, "position")
    assert rows.axes == x.axes
    same(rows, jax.random.permutation(key, x.array, axis=1))
    assert np.array_equal(np.sort(np.asarray(rows.array), axis=1), np.asarray(x.array))
    each = nt.random.permutation(key, x, "position", independent=True)
    same(each, jax.random.permutation(key, x.array, axis=1, independent=True))


def test_random_under_jit_and_grad_through_bounds():
    axes = (nt.Axis("a", 3), nt.Axis("b", 2))
    key = jax.random.key(11)
    jitted = jax.jit(nt.random.normal, static_argnums=1)(key, axes)
    same(jitted, jax.random.normal(key, (3, 2)))

    def mean_draw(lo):
        return nt.mean(nt.random.uniform(key, axes, minval=lo, maxval=lo + 2.0)).scalar()

    lo = nt.named(jnp.array([0.0, 1.0]), (axes[1],))
    g = jax.jit(jax.grad(mean_draw))(lo)
    ref = jax.grad(lambda v: jnp.mean(jax.random.uniform(key, (3, 2), minval=v[None, :], maxval=v[None, :] + 2.0)))(
        lo.array
    )
    assert g.axes == lo.axes
    np.testing.assert_allclose(np.asarray(g.array), np.asarray(ref), rtol=1e-6)


def test_random_errors_name_the_axes():
    key = jax.random.key(0)
    a, b = nt.Axis("a", 2), nt.Axis("b", 3)
    with pytest.raises(TypeError, match=r"normal needs Axis objects \(name and size\), got 'a'"):
        nt.random.normal(key, ("a",))
    with pytest.raises(
        ValueError,
        match=r"uniform: minval has axes \['c'\] that are not among the output axes \(a=2, b=3\)",
    ):
        nt.random.uniform(key, (a, b), minval=nt.zeros(nt.Axis("c", 2)))
    with pytest.raises(
        TypeError,
        match=r"bernoulli: p must be a scalar or a NamedArray, got an unnamed array of shape \(2,\)",
    ):
        nt.random.bernoulli(key, (a,), jnp.full((2,), 0.5))
    with pytest.raises(ValueError, match="Axis 'a' has size 2 in one array and 4 in another"):
        nt.random.uniform(key, (a,), maxval=nt.ones(nt.Axis("a", 4)))
    logits = nt.zeros((a, b))
    with pytest.raises(ValueError, match=r"Unknown axis 'vocab': this array has axes \(a=2, b=3\)"):
        nt.random.categorical(key, logits, "vocab")
    with pytest.raises(ValueError, match=r"categorical: the choice axis 'b' cannot also be an output axis"):
        nt.random.categorical(key, logits, "b", axes=(a, b))
    with pytest.raises(ValueError, match=r"categorical: logits have axes \['a'\] that are not among the output axes"):
        nt.random.categorical(key, logits, "b", axes=(nt.Axis("sample", 4),))
    with pytest.raises(TypeError, match="categorical takes logits as a NamedArray, got ArrayImpl"):
        nt.random.categorical(key, jnp.zeros((2, 3)), "b")
    with pytest.raises(ValueError, match=r"permutation of an array needs the axis to shuffle, one of \(a=2, b=3\)"):
        nt.random.permutation(key, logits)
    with pytest.raises(ValueError, match=r"Unknown axis 'z'"):
        nt.random.permutation(key, logits, "z")
    with pytest.raises(TypeError, match="permutation takes a NamedArray or an Axis, got ArrayImpl"):
        nt.random.permutation(key, jnp.arange(3), "a")
    with pytest.raises(ValueError, match="permutation of Axis 'a' takes no other axis, got 'b'"):
        nt.random.permutation(key, a, "b")
