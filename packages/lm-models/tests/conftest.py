"""Fixtures shared by the lm-models tests."""

import jax
import jax.numpy as jnp
import pytest

import named_tensors as nt
from named_tensors import Axis, NamedArray

VOCAB = Axis("vocab", 64)
SEQ = 16


def token_ids(seed: int, batch: int = 2, length: int = SEQ, vocab: int = VOCAB.size) -> NamedArray:
    """Random ids with axes (batch, position)."""
    ids = jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab, dtype=jnp.int32)
    return nt.named(ids, ("batch", "position"))


@pytest.fixture
def ids_of():
    """token_ids(seed, batch=2, length=16, vocab=64): random ids with axes (batch, position)."""
    return token_ids


def with_random_biases(model, key: jax.Array):
    """(model with every bias drawn at random, how many biases): biases start at zero, hiding a missing one."""
    count = 0

    def draw(path, x):
        nonlocal count
        if isinstance(x, NamedArray) and "bias" in jax.tree_util.keystr(path):
            count += 1
            noise = jax.random.normal(jax.random.fold_in(key, count), x.array.shape, x.dtype)
            return NamedArray(0.1 * noise, x.axes)
        return x

    out = jax.tree_util.tree_map_with_path(draw, model, is_leaf=lambda x: isinstance(x, NamedArray))
    return out, count


@pytest.fixture
def random_biases():
    """with_random_biases(model, key) -> (model, number of biases replaced)."""
    return with_random_biases
