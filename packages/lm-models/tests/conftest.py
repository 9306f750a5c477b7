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
