"""Tiny configs, token ids and a by-name sharding helper shared by the lm-models tests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

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


def mesh_4x2() -> Mesh:
    """A (data=4, model=2) mesh over the 8 forced CPU devices, with Auto axis types."""
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    return Mesh(devices, ("data", "model"))


@pytest.fixture
def mesh() -> Mesh:
    return mesh_4x2()


@pytest.fixture
def shard():
    """shard_by_name(tree, mesh, mapping): NamedArray leaves placed on the mesh by axis name."""
    return shard_by_name


def shard_by_name(tree, mesh: Mesh, mapping: dict[str, str]):
    """Place every NamedArray leaf on the mesh, sharding each axis whose name the mapping lists."""

    def place(x):
        if isinstance(x, NamedArray):
            spec = PartitionSpec(*(mapping.get(a.name) for a in x.axes))
            return NamedArray(jax.device_put(x.array, NamedSharding(mesh, spec)), x.axes)
        return x

    return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, NamedArray))
