"""einsum, rearrange, flatten/unflatten, split, concatenate and stack against plain jax.numpy."""

import re

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
    shape = tuple(names_sizes.values())
    return nt.named(rng.normal(size=shape).astype(np.float32), tuple(names_sizes))


def values_in(x: nt.NamedArray, order: list[str]) -> np.ndarray:
    """x's values with its axes in a given order, for comparison with a positional reference."""
    assert sorted(x.axis_names) == sorted(order)
    return np.asarray(nt.permute(x, order).array)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# -- einsum -------------------------------------------------------------------------------------------------


def test_einsum_projection_matches_jnp():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    w = rand({"heads": 5, "head_size": 6, "embed": 4}, 2)
    y = nt.einsum("batch position embed, heads head_size embed -> batch position heads head_size", x, w)
    assert y.axis_names == ("batch", "position", "heads", "head_size")
    close(y.array, jnp.einsum("bpe,hde->bphd", x.array, w.array))


def test_einsum_output_order_follows_spec():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    w = rand({"heads": 5, "embed": 4}, 2)
    y = nt.einsum("batch position embed, heads embed -> heads batch position", x, w)
    assert y.axis_names == ("heads", "batch", "position")
    close(y.array, jnp.einsum("bpe,he->hbp", x.array, w.array))


def test_einsum_without_arrow_keeps_axes_named_once():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    w = rand({"embed": 4, "mlp": 7}, 2)
    y = nt.einsum("batch position embed, embed mlp", x, w)
    assert y.axis_names == ("batch", "position", "mlp")
    close(y.array, jnp.einsum("bpe,em->bpm", x.array, w.array))


def test_einsum_without_arrow_contracts_every_shared_name():
    # Classic einsum rule: batch is named in both terms, so it is summed over too.
    x = rand({"batch": 2, "embed": 4}, 1)
    y = rand({"batch": 2, "embed": 4, "mlp": 3}, 2)
    z = nt.einsum("batch embed, batch embed mlp", x, y)
    assert z.axis_names == ("mlp",)
    close(z.array, jnp.einsum("be,bem->m", x.array, y.array))


def test_einsum_ellipsis_kept_when_output_has_ellipsis():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    w = rand({"embed": 4, "mlp": 5}, 2)
    y = nt.einsum("... embed, embed mlp -> ... mlp", x, w)
    assert y.axis_names == ("batch", "position", "mlp")
    close(y.array, jnp.einsum("bpe,em->bpm", x.array, w.array))
    y2 = nt.einsum("... embed, embed mlp -> mlp ...", x, w)
    assert y2.axis_names == ("mlp", "batch", "position")


def test_einsum_ellipsis_summed_when_output_lacks_it():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    y = nt.einsum("... embed -> embed", x)
    close(y.array, jnp.sum(x.array, axis=(0, 1)))


def test_einsum_ellipsis_axes_shared_between_arrays_are_aligned():
    x = rand({"batch": 2, "embed": 4}, 1)
    y = rand({"embed": 4, "batch": 2}, 2)
    z = nt.einsum("..., ... -> ...", x, y)
    assert z.axis_names == ("batch", "embed")
    close(z.array, x.array * y.array.T)


def test_einsum_ellipsis_in_output_excludes_axes_named_in_inputs():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    w = rand({"embed": 4, "mlp": 5}, 2)
    y = nt.einsum("... embed, embed mlp -> ...", x, w)
    # mlp is named explicitly in a term, so output '...' does not bring it back: it is summed.
    assert y.axis_names == ("batch", "position")
    close(y.array, jnp.einsum("bpe,em->bp", x.array, w.array))


@SETTINGS
@given(st.permutations(["a", "b", "c"]), st.permutations(["c", "d"]), st.permutations(["a", "d", "b"]))
def test_einsum_is_independent_of_the_order_axes_are_written(x_order, w_order, out_order):
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    x = rand({n: sizes[n] for n in ["a", "b", "c"]}, 3)
    w = rand({n: sizes[n] for n in ["c", "d"]}, 4)
    spec = f"{' '.join(x_order)}, {' '.join(w_order)} -> {' '.join(out_order)}"
    y = nt.einsum(spec, x, w)
    assert list(y.axis_names) == list(out_order)
    expected = jnp.einsum("abc,cd->abd", x.array, w.array)
    close(values_in(y, ["a", "b", "d"]), expected)


def test_einsum_trace_and_outer_product():
    m = rand({"i": 3, "j": 3}, 5)
    total = nt.einsum("i j ->", m)
    assert total.axis_names == ()
    close(total.array, jnp.sum(m.array))
    u, v = rand({"i": 2}, 6), rand({"j": 3}, 7)
    close(nt.einsum("i, j -> j i", u, v).array, jnp.outer(v.array, u.array))


def test_einsum_checks_given_sizes():
    x = rand({"batch": 2, "embed": 4}, 1)
    y = nt.einsum("batch embed -> batch", x, embed=4, batch=2)
    close(y.array, jnp.sum(x.array, axis=1))
    with pytest.raises(ValueError, match=r"axis 'embed' has size 4, but embed=5 was given"):
        nt.einsum("batch embed -> batch", x, embed=5)
    with pytest.raises(ValueError, match=r"size given for unknown axis 'heads'"):
        nt.einsum("batch embed -> batch", x, heads=5)


def test_einsum_under_jit_and_grad():
    x = rand({"batch": 2, "embed": 4}, 1)
    w = rand({"embed": 4, "mlp": 3}, 2)

    def loss(w_named):
        return nt.einsum("batch embed, embed mlp ->", x, w_named).array

    def reference(w_raw):
        return jnp.einsum("be,em->", x.array, w_raw)

    close(jax.jit(loss)(w), reference(w.array))
    g = jax.jit(jax.grad(loss))(w)
    assert g.axis_names == ("embed", "mlp")
    close(g.array, jax.grad(reference)(w.array))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("batch nope -> batch", r"Unknown axis 'nope'"),
        ("batch embed -> heads", r"unknown output axis 'heads'"),
        ("batch embed embed -> batch", r"Duplicate axis name\(s\) \['embed'\]"),
        ("batch embed -> batch batch", r"Duplicate axis name\(s\) \['batch'\]"),
        ("batch -> batch", r"does not name axes \['embed'\].*add '\.\.\.'"),
        ("batch embed, embed -> batch", r"2 input term\(s\) but 1 arrays"),
        ("batch embed -> batch -> embed", r"more than one '->'"),
        ("batch embed -> batch, embed", r"single term"),
        ("batch em-bed -> batch", r"bad token '-bed'"),
        ("batch (embed) -> batch", r"groups '\(\.\.\.\)' are not allowed"),
        ("... embed ... -> embed", r"'\.\.\.' appears twice"),
        ("batch embed : -> batch", r"unexpected token ':'"),
    ],
)
def test_einsum_errors(spec, message):
    x = rand({"batch": 2, "embed": 4}, 1)
    with pytest.raises(ValueError, match=message):
        nt.einsum(spec, x)


def test_einsum_size_mismatch_between_arrays_names_the_axis():
    x = rand({"batch": 2, "embed": 4}, 1)
    w = rand({"embed": 5, "mlp": 3}, 2)
    with pytest.raises(ValueError, match=r"Axis 'embed' has size 4 in one array and 5 in another"):
        nt.einsum("batch embed, embed mlp -> batch mlp", x, w)


def test_einsum_rejects_unnamed_arrays():
    with pytest.raises(TypeError, match="einsum takes NamedArrays, got ndarray"):
        nt.einsum("a -> a", np.ones(3))


# -- rearrange ----------------------------------------------------------------------------------------------


def test_rearrange_unflatten_with_keyword_size():
    x = rand({"batch": 2, "position": 12, "embed": 3}, 1)
    y = nt.rearrange(x, "batch (position block) embed -> batch position block embed", block=4)
    assert y.axes == (Axis("batch", 2), Axis("position", 3), Axis("block", 4), Axis("embed", 3))
    close(y.array, x.array.reshape(2, 3, 4, 3))


def test_rearrange_flatten_names_group_after_its_first_member_or_its_label():
    x = rand({"batch": 2, "heads": 3, "head_size": 4}, 1)
    y = nt.rearrange(x, "batch heads head_size -> batch (heads head_size)")
    assert y.axes == (Axis("batch", 2), Axis("heads", 12))
    close(y.array, x.array.reshape(2, 12))
    z = nt.rearrange(x, "batch heads head_size -> (q: head_size heads) batch")
    assert z.axes == (Axis("q", 12), Axis("batch", 2))
    close(z.array, jnp.transpose(x.array, (2, 1, 0)).reshape(12, 2))


def test_rearrange_labelled_group_on_the_left_splits_that_axis():
    x = rand({"batch": 2, "q": 12}, 1)
    heads = Axis("heads", 3)
    y = nt.rearrange(x, "(q: heads head_size) batch -> batch head_size heads", heads=heads)
    assert y.axes == (Axis("batch", 2), Axis("head_size", 4), Axis("heads", 3))
    close(y.array, jnp.transpose(x.array.T.reshape(3, 4, 2), (2, 1, 0)))


def test_rearrange_takes_positional_axis_objects_for_sizes():
    x = rand({"batch": 2, "q": 12}, 1)
    y = nt.rearrange(x, "batch (q: heads head_size) -> batch heads head_size", Axis("heads", 3), Axis("head_size", 4))
    close(y.array, x.array.reshape(2, 3, 4))


def test_rearrange_single_member_groups_rename():
    x = rand({"batch": 2, "position": 5}, 1)
    y = nt.rearrange(x, "batch position -> (key_position: position) batch")
    assert y.axes == (Axis("key_position", 5), Axis("batch", 2))
    close(y.array, x.array.T)
    z = nt.rearrange(x, "batch (position: seq) -> seq batch")
    assert z.axis_names == ("seq", "batch")


def test_rearrange_ellipsis_keeps_other_axes_in_order():
    x = rand({"batch": 2, "position": 6, "embed": 3, "heads": 4}, 1)
    y = nt.rearrange(x, "... (position block) -> block ... position", block=2)
    assert y.axis_names == ("block", "batch", "embed", "heads", "position")
    expected = jnp.transpose(x.array.reshape(2, 3, 2, 3, 4), (2, 0, 3, 4, 1))
    close(y.array, expected)


def test_rearrange_left_side_is_matched_by_name_not_position():
    x = rand({"batch": 2, "position": 3, "embed": 4}, 1)
    a = nt.rearrange(x, "embed batch position -> position embed batch")
    b = nt.rearrange(x, "batch position embed -> position embed batch")
    close(a.array, b.array)
    close(a.array, jnp.transpose(x.array, (1, 2, 0)))


@SETTINGS
@given(st.data())
def test_rearrange_permutation_matches_transpose(data):
    names = ["a", "b", "c", "d"][: data.draw(st.integers(1, 4))]
    sizes = {n: data.draw(st.integers(1, 3)) for n in names}
    x = rand(sizes, 2)
    out = data.draw(st.permutations(names))
    y = nt.rearrange(x, f"{' '.join(names)} -> {' '.join(out)}")
    assert list(y.axis_names) == list(out)
    close(y.array, jnp.transpose(x.array, [names.index(n) for n in out]))


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.permutations(["i", "j", "k"]))
def test_rearrange_split_then_merge_matches_reshape_transpose(i, j, k, order):
    x = rand({"batch": 2, "flat": i * j * k}, 5)
    merged = nt.rearrange(x, f"batch (flat: i j k) -> (m: {' '.join(order)}) batch", i=i, j=j)
    sizes = {"i": i, "j": j, "k": k}
    expected = jnp.transpose(x.array.reshape(2, i, j, k), [1 + "ijk".index(n) for n in order] + [0])
    assert merged.axes == (Axis("m", i * j * k), Axis("batch", 2))
    close(merged.array, expected.reshape(i * j * k, 2))
    back = nt.rearrange(merged, f"(m: {' '.join(order)}) batch -> batch (flat: i j k)", **sizes)
    close(back.array, x.array)


def test_rearrange_under_jit_and_grad():
    x = rand({"batch": 2, "position": 6}, 1)
    weights = jnp.arange(6.0).reshape(3, 2)

    def f(x_named):
        y = nt.rearrange(x_named, "batch (position block) -> position block batch", block=2)
        return jnp.sum(y.array * weights[:, :, None])

    g = jax.jit(jax.grad(f))(x)
    assert g.axis_names == ("batch", "position")
    close(g.array, jnp.broadcast_to(weights.reshape(6), (2, 6)))


@pytest.mark.parametrize(
    ("spec", "sizes", "message"),
    [
        ("batch position -> batch pos-ition", {}, r"bad token '-ition'"),
        ("batch position -> batch position!", {}, r"bad token '!'"),
        ("batch position", {}, r"needs '->'"),
        ("batch (position block -> batch position block", {"block": 2}, r"unclosed '\('"),
        ("batch (position (block)) -> batch", {}, r"unexpected token '\(' inside a group"),
        ("batch () position -> batch position", {}, r"empty group"),
        ("batch position) -> batch position", {}, r"unexpected token '\)'"),
        ("batch position, batch -> batch position", {}, r"unexpected token ','"),
        ("batch (position ...) -> batch position", {}, r"unexpected token '\.\.\.' inside a group"),
        ("... position -> batch position", {}, r"'\.\.\.' must appear on both sides"),
        ("batch nope -> batch nope", {}, r"Unknown axis 'nope'"),
        ("batch -> batch", {}, r"does not name axes \['position'\]"),
        ("batch position -> batch", {}, r"axes \['position'\] of the left side are missing on the right"),
        ("batch position -> batch position heads", {}, r"unknown axis 'heads' on the right side"),
        ("batch position -> batch position position", {}, r"Duplicate axis name\(s\) \['position'\]"),
        ("batch batch position -> batch position", {}, r"Duplicate axis name\(s\) \['batch'\]"),
        ("batch (position a b) -> batch position a b", {}, r"cannot infer the sizes of \['position', 'a', 'b'\]"),
        ("batch (position a) -> batch position a", {"a": 4}, r"'position' of size 6 does not split evenly"),
        ("batch (position a) -> batch position a", {"a": 3, "position": 3}, r"product is 9"),
        ("batch position -> batch position", {"heads": 3}, r"sizes given for axes \['heads'\]"),
        ("batch position -> batch position", {"position": 5}, r"'position' has size 6, but size 5"),
        ("batch (position batch) -> batch position", {}, r"Duplicate axis name\(s\) \['batch'\]"),
        ("batch (q: position a) -> batch q a", {"a": 2}, r"Unknown axis 'q'"),
        ("batch position -> (position: batch) position", {}, r"Duplicate axis name\(s\) \['position'\]"),
    ],
)
def test_rearrange_errors(spec, sizes, message):
    x = rand({"batch": 2, "position": 6}, 1)
    with pytest.raises(ValueError, match=message):
        nt.rearrange(x, spec, **sizes)


def test_rearrange_bad_size_types():
    x = rand({"batch": 2, "position": 6}, 1)
    with pytest.raises(TypeError, match=r"size of 'block' must be a non-negative int or an Axis, got 2.5"):
        nt.rearrange(x, "batch (position block) -> batch position block", block=2.5)
    with pytest.raises(TypeError, match=r"positional sizes must be Axis objects, got 'block'"):
        nt.rearrange(x, "batch (position block) -> batch position block", "block")
    with pytest.raises(ValueError, match=r"axis 'block' is given sizes 2 and 3"):
        nt.rearrange(x, "batch (position block) -> batch position block", Axis("block", 2), block=3)


# -- flatten_axes / unflatten_axis --------------------------------------------------------------------------


def test_flatten_axes_puts_merged_axis_where_the_first_one_was():
    x = rand({"batch": 2, "heads": 3, "position": 5, "head_size": 4}, 1)
    y = nt.flatten_axes(x, ["heads", "head_size"], "q")
    assert y.axes == (Axis("batch", 2), Axis("q", 12), Axis("position", 5))
    close(y.array, jnp.transpose(x.array, (0, 1, 3, 2)).reshape(2, 12, 5))
    z = nt.flatten_axes(x, [Axis("head_size", 4), "heads"], Axis("q", 12))
    close(z.array, jnp.transpose(x.array, (0, 3, 1, 2)).reshape(2, 12, 5))


@SETTINGS
@given(st.permutations(["a", "b", "c"]), st.integers(1, 3), st.integers(1, 3))
def test_flatten_then_unflatten_round_trips(order, na, nb):
    x = rand({"a": na, "b": nb, "c": 2}, 7)
    merged = nt.flatten_axes(x, order[:2], "m")
    back = nt.unflatten_axis(merged, "m", [x.resolve_axis(n) for n in order[:2]])
    close(values_in(back, ["a", "b", "c"]), x.array)


def test_unflatten_axis_in_place_matches_reshape():
    x = rand({"batch": 2, "q": 12, "position": 5}, 1)
    y = nt.unflatten_axis(x, "q", [Axis("heads", 3), Axis("head_size", 4)])
    assert y.axis_names == ("batch", "heads", "head_size", "position")
    close(y.array, x.array.reshape(2, 3, 4, 5))


def test_flatten_unflatten_errors():
    x = rand({"batch": 2, "q": 12}, 1)
    with pytest.raises(ValueError, match=r"Unknown axis 'nope'"):
        nt.flatten_axes(x, ["batch", "nope"], "m")
    with pytest.raises(ValueError, match=r"merging \(batch=2, q=12\) gives size 24, but new axis 'm' has size 5"):
        nt.flatten_axes(x, ["batch", "q"], Axis("m", 5))
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['q'\]"):
        nt.flatten_axes(x, ["q", "q"], "m")
    with pytest.raises(ValueError, match=r"at least one axis"):
        nt.flatten_axes(x, [], "m")
    with pytest.raises(ValueError, match=r"axis 'q' has size 12, but \(heads=5, head_size=4\) multiply to 20"):
        nt.unflatten_axis(x, "q", [Axis("heads", 5), Axis("head_size", 4)])
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['batch'\]"):
        nt.unflatten_axis(x, "q", [Axis("batch", 3), Axis("head_size", 4)])
    with pytest.raises(TypeError, match=r"needs Axis objects"):
        nt.unflatten_axis(x, "q", ["heads", "head_size"])
    with pytest.raises(ValueError, match=r"Unknown axis 'nope'"):
        nt.unflatten_axis(x, "nope", [Axis("a", 12)])


# -- split / concatenate / stack ----------------------------------------------------------------------------


def test_split_matches_jnp_split():
    x = rand({"batch": 2, "mlp": 10}, 1)
    parts = nt.split(x, "mlp", [Axis("gate", 3), Axis("up", 3), Axis("rest", 4)])
    assert [p.axis_names for p in parts] == [("batch", "gate"), ("batch", "up"), ("batch", "rest")]
    for got, want in zip(parts, jnp.split(x.array, [3, 6], axis=1), strict=True):
        close(got.array, want)


def test_split_errors():
    x = rand({"batch": 2, "mlp": 10}, 1)
    with pytest.raises(ValueError, match=r"axis 'mlp' has size 10, but the pieces \(a=3, b=3\) add up to 6"):
        nt.split(x, "mlp", [Axis("a", 3), Axis("b", 3)])
    with pytest.raises(ValueError, match=r"Unknown axis 'nope'"):
        nt.split(x, "nope", [Axis("a", 10)])
    with pytest.raises(ValueError, match=r"Duplicate axis name\(s\) \['batch'\]"):
        nt.split(x, "mlp", [Axis("batch", 10)])
    with pytest.raises(TypeError, match=r"^split needs Axis objects \(with sizes\), got 'a'$"):
        nt.split(x, "mlp", ["a", Axis("b", 10)])


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.data())
def test_concatenate_aligns_by_name(lengths, data):
    pieces = []
    for i, n in enumerate(lengths):
        order = data.draw(st.permutations(["batch", "position", "embed"]))
        sizes = {"batch": 2, "position": n, "embed": 3}
        pieces.append(rand({k: sizes[k] for k in order}, 10 + i))
    y = nt.concatenate("position", pieces)
    assert y.resolve_axis("position").size == sum(lengths)
    assert y.axis_names == pieces[0].axis_names
    expected = jnp.concatenate([values_in(p, ["batch", "position", "embed"]) for p in pieces], axis=1)
    close(values_in(y, ["batch", "position", "embed"]), expected)


def test_concatenate_under_grad():
    a = rand({"batch": 2, "position": 3}, 1)
    b = rand({"position": 4, "batch": 2}, 2)
    weights = jnp.arange(14.0).reshape(2, 7)

    def f(a, b):
        return jnp.sum(nt.concatenate(Axis("position", 7), [a, b]).array * weights)

    ga, gb = jax.jit(jax.grad(f, argnums=(0, 1)))(a, b)
    close(ga.array, weights[:, :3])
    close(gb.array, weights[:, 3:].T)


def test_concatenate_errors():
    a = rand({"batch": 2, "position": 3}, 1)
    with pytest.raises(ValueError, match=r"unknown axis 'position' in an array with axes \(batch=2, embed=3\)"):
        nt.concatenate("position", [a, rand({"batch": 2, "embed": 3}, 2)])
    with pytest.raises(
        ValueError, match=r"different axes, \(batch=2, position=3\) and \(batch=2, embed=3, position=1\)"
    ):
        nt.concatenate("position", [a, rand({"batch": 2, "embed": 3, "position": 1}, 2)])
    with pytest.raises(ValueError, match=r"Axis 'batch' has size 2 in one array and 5 in another"):
        nt.concatenate("position", [a, rand({"batch": 5, "position": 1}, 2)])
    with pytest.raises(ValueError, match=r"pieces of axis 'position' add up to 6, not to 7"):
        nt.concatenate(Axis("position", 7), [a, a])
    with pytest.raises(ValueError, match=r"concatenate needs at least one array"):
        nt.concatenate("position", [])
    with pytest.raises(ValueError, match=r"unknown axis 'nope' in an array with axes \(batch=2, position=3\)"):
        nt.concatenate("nope", [a, a])


def test_stack_aligns_by_name_and_puts_new_axis_first():
    a = rand({"batch": 2, "embed": 3}, 1)
    b = rand({"embed": 3, "batch": 2}, 2)
    y = nt.stack("layers", [a, b])
    assert y.axes == (Axis("layers", 2), Axis("batch", 2), Axis("embed", 3))
    close(y.array, jnp.stack([a.array, b.array.T]))
    z = nt.stack(Axis("layers", 2), [a, b])
    close(z.array, y.array)


def test_stack_under_jit_and_grad():
    a = rand({"batch": 2, "embed": 3}, 1)
    b = rand({"embed": 3, "batch": 2}, 2)
    weights = jnp.arange(12.0).reshape(2, 2, 3)

    def f(a, b):
        return jnp.sum(nt.stack("layers", [a, b]).array * weights)

    ga, gb = jax.jit(jax.grad(f, argnums=(0, 1)))(a, b)
    close(ga.array, weights[0])
    close(gb.array, weights[1].T)


def test_stack_errors():
    a = rand({"batch": 2, "embed": 3}, 1)
    with pytest.raises(ValueError, match=r"new axis 'batch' already exists"):
        nt.stack("batch", [a, a])
    with pytest.raises(ValueError, match=r"new axis 'layers' has size 3, but 2 arrays were given"):
        nt.stack(Axis("layers", 3), [a, a])
    with pytest.raises(ValueError, match=r"different axes, \(batch=2, embed=3\) and \(batch=2\)"):
        nt.stack("layers", [a, rand({"batch": 2}, 2)])
    with pytest.raises(ValueError, match=r"Axis 'embed' has size 3 in one array and 4 in another"):
        nt.stack("layers", [a, rand({"batch": 2, "embed": 4}, 2)])
    with pytest.raises(TypeError, match=r"stack takes NamedArrays, got ndarray"):
        nt.stack("layers", [a, np.ones((2, 3))])


def test_errors_name_the_spec():
    x = rand({"batch": 2}, 1)
    with pytest.raises(ValueError, match=re.escape("in spec 'batch -> batch?'")):
        nt.rearrange(x, "batch -> batch?")


def test_einsum_passes_preferred_element_type():
    x = rand({"batch": 2, "embed": 4}, 1).astype(jnp.bfloat16)
    w = rand({"embed": 4}, 2).astype(jnp.bfloat16)
    y = nt.einsum("batch embed, embed -> batch", x, w, preferred_element_type=jnp.float32)
    assert y.dtype == jnp.float32
    expected = x.array.astype(jnp.float32) @ w.array.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(y.array), np.asarray(expected), rtol=1e-2)


def test_stack_and_concatenate_need_arrays():
    with pytest.raises(ValueError, match=r"stack needs at least one array"):
        nt.stack("layers", [])


def test_remaining_type_and_label_errors():
    x = rand({"batch": 2, "position": 6}, 1)
    with pytest.raises(TypeError, match=r"einsum needs a spec string, got list"):
        nt.einsum(["batch"], x)
    with pytest.raises(TypeError, match=r"rearrange takes a NamedArray, got ndarray"):
        nt.rearrange(np.ones((2, 6)), "batch position -> position batch")
    with pytest.raises(ValueError, match=r"bad group label '\.\.\.' in spec"):
        nt.rearrange(x, "batch (...: a b) -> batch a b")
    with pytest.raises(TypeError, match=r"split needs Axis objects \(with sizes\), got 'a'"):
        nt.split(x, "position", ["a", "b"])


def test_permute_rejects_two_ellipses():
    # Guards a fix in core.permute, which used to accept ["a", ..., ...] silently.
    x = rand({"a": 2, "b": 3}, 1)
    with pytest.raises(ValueError, match=r"permute takes at most one '\.\.\.'"):
        nt.permute(x, ["a", ..., ...])
