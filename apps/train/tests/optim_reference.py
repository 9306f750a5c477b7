"""Shared by the optimizer tests: a small tree of named parameters, and running an optimizer over it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import named_tensors as nt
from named_tensors.nn import Linear

Layers, Heads, HeadSize = nt.Axis("layers", 2), nt.Axis("heads", 2), nt.Axis("head_size", 3)
Embed, Mlp, Vocab = nt.Axis("embed", 8), nt.Axis("mlp", 4), nt.Axis("vocab", 6)


def small_params(seed: int = 0) -> dict:
    """Two stacked Linears (3 axes out), one plain Linear with a bias, an embedding table and a norm."""
    rng = np.random.default_rng(seed)

    def named(*axes: nt.Axis) -> nt.NamedArray:
        return nt.NamedArray(jnp.asarray(rng.normal(size=[a.size for a in axes]).astype(np.float32)), axes)

    return {
        "q": Linear(named(Layers, Heads, HeadSize, Embed), None, (Embed,), (Heads, HeadSize)),
        "o": Linear(named(Layers, Embed, Heads, HeadSize), None, (Heads, HeadSize), (Embed,)),
        "up": Linear(named(Mlp, Embed), named(Mlp), (Embed,), (Mlp,)),
        "tokens": named(Vocab, Embed),
        "norm": named(Embed),
    }


def random_grads(params: dict, rng: np.random.Generator) -> dict:
    """A gradient of the same tree, drawn from `rng`."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params)


def run_optimizer(optimizer, params: dict, grads: list[dict]) -> list[dict]:
    """The params after each of the steps (jit-compiled update), as numpy arrays keyed by path."""
    update = jax.jit(optimizer.update)
    out = []
    with jax.numpy_dtype_promotion("standard"):
        state = optimizer.init(params)
        for g in grads:
            updates, state = update(g, state, params)
            params = optax.apply_updates(params, updates)
            out.append(flat(params))
    return out


def flat(tree) -> dict[str, np.ndarray]:
    """{path: array} of a tree (NamedArrays as their arrays)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {nt.path_str(path): np.asarray(leaf) for path, leaf in leaves}
