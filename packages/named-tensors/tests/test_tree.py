import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from named_tensors import Axis, NamedArray

Vocab = Axis("vocab", 11)
Embed = Axis("embed", 4)
Mlp = Axis("mlp", 6)
Layers = Axis("layers", 3)


class Block(eqx.Module):
    w: NamedArray  # (embed, mlp)
    norm_scale: NamedArray  # (embed,)


class Model(eqx.Module):
    embedding: NamedArray  # (vocab, embed)
    blocks: nt.Stacked
    step: jax.Array  # an int array: not a parameter
    activation: object = jnp.tanh


def make_model() -> Model:
    def make_block(key):
        return Block(nt.random.normal(key, (Embed, Mlp)), nt.ones(Embed))

    return Model(
        nt.random.normal(jax.random.key(0), (Vocab, Embed)),
        nt.Stacked.init(Layers, make_block, key=jax.random.key(1)),
        jnp.array(3, dtype=jnp.int32),
    )


def test_count_parameters_counts_floating_scalars():
    model = make_model()
    expected = Vocab.size * Embed.size + Layers.size * (Embed.size * Mlp.size + Embed.size)
    assert nt.count_parameters(model) == expected
    assert nt.count_parameters(model, nt.with_axis("vocab")) == Vocab.size * Embed.size
    assert nt.count_parameters(model, lambda x: True) == expected + 1  # the int step counts when asked


def test_tree_map_hands_named_arrays_whole():
    model = make_model()
    seen = []
    out = nt.tree_map(lambda x: seen.append(type(x).__name__) or x, model)
    assert seen.count("NamedArray") == 3
    doubled = nt.tree_map(lambda x: x * 2.0 if nt.is_named(x) else x, model)
    assert doubled.blocks.stacked.w.axes == (Layers, Embed, Mlp)
    np.testing.assert_allclose(doubled.embedding.array, 2.0 * model.embedding.array)
    assert out.activation is jnp.tanh
    assert len(nt.tree_leaves(model)) == 5  # 3 NamedArrays, the step, the activation


def test_path_of_leaves_is_dotted():
    model = make_model()
    selected, _ = nt.partition(model, nt.path_matches(r"^blocks\.stacked\.w$"))
    assert selected.blocks.stacked.w is model.blocks.stacked.w
    assert selected.blocks.stacked.norm_scale is None and selected.embedding is None


def test_partition_and_combine_round_trip():
    model = make_model()
    with_vocab, rest = nt.partition(model, nt.with_axis("vocab"))
    assert with_vocab.embedding is model.embedding and with_vocab.blocks.stacked.w is None
    assert rest.embedding is None and rest.blocks.stacked.w is model.blocks.stacked.w
    assert rest.activation is jnp.tanh and with_vocab.activation is None
    again = nt.combine(with_vocab, rest)
    assert jax.tree.structure(again, is_leaf=nt.is_named) == jax.tree.structure(model, is_leaf=nt.is_named)
    for a, b in zip(nt.tree_leaves(again), nt.tree_leaves(model), strict=True):
        assert a is b


def test_filters_compose():
    model = make_model()
    decay = nt.is_floating & ~nt.path_matches("norm_scale")
    flags = nt.mask(model, decay)
    assert flags.embedding is True and flags.blocks.stacked.w is True
    assert flags.blocks.stacked.norm_scale is False and flags.step is False and flags.activation is False
    either = nt.mask(model, nt.with_axis("vocab") | nt.path_matches("norm"))
    assert (either.embedding, either.blocks.stacked.w, either.blocks.stacked.norm_scale) == (True, False, True)
    assert "is_floating" in repr(decay)


def test_freezing_by_partition_gives_gradients_only_for_the_trainable_part():
    model = make_model()
    trainable, frozen = nt.partition(model, nt.is_floating & ~nt.with_axis("vocab"))

    def loss(trainable):
        m = nt.combine(trainable, frozen)
        h = nt.dot(m.embedding, m.blocks.stacked.w, axis=Embed)
        return nt.sum(h * 1.0).scalar()

    grads = jax.grad(loss)(trainable)
    assert grads.embedding is None
    assert grads.blocks.stacked.w.axes == (Layers, Embed, Mlp)
    expected = jnp.broadcast_to(model.embedding.array.sum(0)[None, :, None], (Layers.size, Embed.size, Mlp.size))
    np.testing.assert_allclose(grads.blocks.stacked.w.array, expected, rtol=1e-5)


def test_filter_errors():
    with pytest.raises(ValueError, match="invalid regular expression"):
        nt.path_matches("(")
    with pytest.raises(ValueError, match="with_axis needs at least one axis name"):
        nt.with_axis()
    with pytest.raises(TypeError, match=r"A filter is an nt\.Filter or a callable"):
        nt.partition(make_model(), "embed")
    with pytest.raises(ValueError, match="combine needs at least one tree"):
        nt.combine()
