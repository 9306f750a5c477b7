"""The Kronecker factors of PSGD Kron, block by block: which dimensions get a triangular factor, the factors' fit,
their balancing, and the preconditioned direction (the formulas are in lm_train.optim.kron's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm_train.optim.blocks import BlockView, merge_dims, split_batch_axes

_DAMPING = float(np.sqrt(np.finfo(np.float32).eps))  # psgd's: the square root of float32's machine epsilon
_TINY = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class KronLayout(BlockView):
    """Kron's block view of one parameter, with which of a block's dimensions get a triangular factor."""

    triangular: tuple[bool, ...] = ()
    """Per dimension of a block: a triangular factor (True) or a diagonal one (False)."""


def kron_layout(
    leaf: Any,
    *,
    max_size_triangular: int,
    min_ndim_triangular: int,
    memory_save_mode: str | None,
    merge_small_dims: bool,
    target_merged_dim_size: int,
    partition_grads_into_blocks: bool,
    block_size: int,
) -> KronLayout:
    """The block view of one parameter (a NamedArray, whose `layers` axis is a batch; or a plain array)."""
    order, batch, dims = split_batch_axes(leaf)
    merged = merge_dims(dims, target_merged_dim_size) if merge_small_dims else dims
    merged = merged or (1,)
    diagonal = [memory_save_mode == "all_diag"] * len(merged)
    if memory_save_mode == "one_diag":
        diagonal[max(range(len(merged)), key=lambda i: (merged[i], i))] = True  # the largest; the last of equals
    for i, d in enumerate(merged):
        if d == 1 or d > max_size_triangular or len(dims) < min_ndim_triangular:
            diagonal[i] = True
    cut = [partition_grads_into_blocks and not diag and d > block_size and d % block_size == 0 for d, diag in
           zip(merged, diagonal, strict=True)]  # fmt: skip
    return KronLayout(
        order=order,
        batch=batch,
        merged=merged,
        blocks=tuple(d // block_size if c else 1 for d, c in zip(merged, cut, strict=True)),
        triangular=tuple(not diag for diag in diagonal),
    )


# -- the math on one block (a tuple of factors, one per dimension: (d, d) triangular or (d,) diagonal) ----------


def _along(x: jax.Array, i: int, q: jax.Array, transpose: bool = False) -> jax.Array:
    """x x_i q (x x_i q^T with transpose); a diagonal q scales dimension i."""
    if q.ndim == 1:
        return x * q.reshape([-1 if j == i else 1 for j in range(x.ndim)])
    return jnp.moveaxis(jnp.tensordot(q.T if transpose else q, x, axes=([1], [i])), 0, i)


def _solve_along(x: jax.Array, i: int, q: jax.Array) -> jax.Array:
    """x x_i q^{-T}: dimension i times the inverse of the upper-triangular q, by a triangular solve."""
    if q.ndim == 1:
        return x / q.reshape([-1 if j == i else 1 for j in range(x.ndim)])
    y = jnp.moveaxis(x, i, -1)
    return jnp.moveaxis(y @ upper_inverse(q), -1, i)


# Blocks of at most this size are inverted by back substitution; larger ones recursively, by halves.
_BACK_SUBSTITUTION_SIZE = 32


def upper_inverse(q: jax.Array) -> jax.Array:
    """The inverse of the upper-triangular q (d, d), in matmuls and a short loop, without LAPACK.

    Not jax.lax.linalg.triangular_solve: on CPU it calls LAPACK through a kernel that splits a batch (the layers
    of a vmapped stack) over XLA's intra-op threads and blocks until they finish. Two such solves running at once
    on a 2-thread pool each held a thread waiting for work that had no thread left: the step hung at 0% CPU.
    """
    d = q.shape[-1]
    if d <= _BACK_SUBSTITUTION_SIZE:
        return _back_substitution_inverse(q)
    h = d // 2
    a_inv, c_inv = upper_inverse(q[:h, :h]), upper_inverse(q[h:, h:])
    top = jnp.concatenate([a_inv, -(a_inv @ q[:h, h:]) @ c_inv], axis=1)
    bottom = jnp.concatenate([jnp.zeros((d - h, h), q.dtype), c_inv], axis=1)
    return jnp.concatenate([top, bottom], axis=0)


def _back_substitution_inverse(q: jax.Array) -> jax.Array:
    """The inverse of a small upper-triangular q, row by row from the last: x_i = (e_i - q_i,>i x_>i) / q_ii."""
    d = q.shape[-1]
    eye, later = jnp.eye(d, dtype=q.dtype), jnp.arange(d)

    def row(k: int, x: jax.Array) -> jax.Array:
        i = d - 1 - k
        above = jnp.where(later > i, q[i], 0) @ x
        return x.at[i].set((eye[i] - above) / q[i, i])

    return jax.lax.fori_loop(0, d, row, jnp.zeros_like(q))


def _gram(x: jax.Array, i: int, diagonal: bool) -> jax.Array:
    """x_(i) x_(i)^T, contracted over every dimension but i (only its diagonal when `diagonal`)."""
    others = [j for j in range(x.ndim) if j != i]
    if diagonal:
        return jnp.sum(x * x, axis=others)
    return jnp.tensordot(x, x, axes=(others, others))


def norm_lower_bound(a: jax.Array) -> jax.Array:
    """A cheap lower bound of the spectral norm of the symmetric a: |a y| for y = a c / |a c|, c its largest column."""
    max_abs = jnp.max(jnp.abs(a))

    def bound(a: jax.Array) -> jax.Array:
        a = a / max_abs
        column = jnp.take(a, jnp.argmax(jnp.sum(a * a, axis=0)), axis=1)
        y = column @ a
        return max_abs * jnp.linalg.norm((y / jnp.linalg.norm(y)) @ a.T)

    return jnp.where(max_abs > 0, bound(a), max_abs)  # a zero matrix: 0 (the NaN of bound(0) is dropped)


def refresh_factors(qs: tuple[jax.Array, ...], g: jax.Array, v: jax.Array, lr: float) -> tuple[jax.Array, ...]:
    """One fit step of a block's factors towards whitening g, with the probe v (the module doc's factor update)."""
    g = g + _DAMPING * jnp.mean(jnp.abs(g)) * v
    a, c = g, v
    for i, q in enumerate(qs):
        a, c = _along(a, i, q), _solve_along(c, i, q)
    new = []
    for i, q in enumerate(qs):
        diagonal = q.ndim == 1
        t1, t2 = _gram(a, i, diagonal), _gram(c, i, diagonal)
        if diagonal:
            q = q - lr / (jnp.max(jnp.abs(t1 + t2)) + _TINY) * (t1 - t2) * q
        else:
            q = q - lr / (norm_lower_bound(t1 + t2) + _TINY) * jnp.triu(t1 - t2) @ q
        new.append(q)
    return tuple(new)


def balance_factors(qs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """The factors rescaled to the geometric mean of their max |entries| (their Kronecker product unchanged)."""
    norms = jnp.stack([jnp.max(jnp.abs(q)) for q in qs])
    scales = jnp.exp(jnp.mean(jnp.log(norms))) / norms
    return tuple(q * scales[i].astype(q.dtype) for i, q in enumerate(qs))


def precondition(qs: tuple[jax.Array, ...], g: jax.Array) -> jax.Array:
    """P g = g x_i (Q_i^T Q_i)."""
    for i, q in enumerate(qs):
        g = _along(g, i, q.astype(g.dtype))
    for i, q in enumerate(qs):
        g = _along(g, i, q.astype(g.dtype), transpose=True)
    return g
