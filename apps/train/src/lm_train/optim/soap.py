"""SOAP (Vyas et al., 2024, arXiv 2409.11321): Adam run in the eigenbasis of Shampoo's preconditioner.

For a block G of a gradient, with a Kronecker factor L_i (d_i x d_i) on each dimension i small enough, and Q_i
its eigenvectors (Algorithm 3 of the paper):

    M = b1 M + (1 - b1) G                                  first moment, in the parameter's own basis
    G' = G x_i Q_i^T   (each factored dimension rotated)   V = b2 V + (1 - b2) G'^2   (second moment, rotated)
    N = ((M x_i Q_i^T) / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + eps),   update = N x_i Q_i   (rotated back)
    L_i = shampoo_beta L_i + (1 - shampoo_beta) G_(i) G_(i)^T;   every precondition_frequency steps Q_i = eigh(L_i)

The first call only starts the factors (L from G, Q from L) and moves nothing, as the official implementation does;
t counts the steps after it. Q is recomputed exactly with eigh (the paper's Algorithm 3), not with the official
code's single power-iteration/QR step. A dimension larger than `max_precond_dim` gets no factor: it stays in
Adam's diagonal basis; a parameter with one dimension (a bias, a norm; `layers` not counted) is plain Adam.

How a parameter is cut into blocks (Levanter's keys): its stacked `layers` axis is a batch of separate blocks;
with `merge_small_dims`, neighbouring dimensions are merged while their product stays <= target_merged_dim_size;
with `partition_grads_into_blocks`, each dimension that block_size divides and exceeds is cut into blocks of
block_size, each block with its own factors. Every step is a reshape and transpose of the parameter, so the moments
are stored in the parameter's own layout (sharded as it is); the factors are small and replicated.

Sharding: each parameter's update is gathered and computed whole on every device (shard_map), then cut back
to the parameter's layout. The factors of the first steps are of low rank, and eigh's basis of a degenerate
eigenspace (on which Adam's per-coordinate scaling, hence the update, depends) follows the last bit of the factor;
the Gram matrices summed over shards in another order (what XLA's partitioner makes of a sharded contraction)
gave another update on 8 devices than on one. Whole, the update is the same bits on any mesh. On CPU, eigh runs
one matrix per LAPACK call with OpenBLAS on one thread: batched, on 8 simulated devices, the step deadlocked
(lm_train.optim.cpu_lapack says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

import named_tensors as nt
from lm_train.optim.blocks import BlockView, leaves, merge_dims, raw, split_batch_axes
from lm_train.optim.cpu_lapack import eigenvectors, single_threaded_blas

PyTree = Any


@dataclass(frozen=True)
class BlockLayout(BlockView):
    """SOAP's block view of one parameter, with which of a block's dimensions get a Kronecker factor."""

    soap: bool = True
    """False for parameters with fewer than two dimensions: plain Adam."""
    max_precond_dim: int = 10000

    @property
    def factored(self) -> tuple[bool, ...]:
        """Which dimensions of a block get a Kronecker factor."""
        return tuple(self.soap and d <= self.max_precond_dim for d in self.block)


def block_layout(
    leaf: Any,
    *,
    max_precond_dim: int,
    merge_small_dims: bool,
    target_merged_dim_size: int,
    partition_grads_into_blocks: bool,
    block_size: int,
) -> BlockLayout:
    """The block view of one parameter (a NamedArray, whose `layers` axis is a batch; or a plain array)."""
    order, batch, dims = split_batch_axes(leaf)
    merged = merge_dims(dims, target_merged_dim_size) if merge_small_dims else dims
    if not merged:
        merged = (1,)
    cut = partition_grads_into_blocks
    blocks = tuple(d // block_size if cut and d > block_size and d % block_size == 0 else 1 for d in merged)
    return BlockLayout(
        order=order,
        batch=batch,
        merged=merged,
        blocks=blocks,
        soap=len(dims) >= 2,
        max_precond_dim=max_precond_dim,
    )


# -- the math on one block -----------------------------------------------------------------------------------


def _rotate(x: jax.Array, qs: tuple[jax.Array | None, ...], back: bool) -> jax.Array:
    """x with each factored dimension i multiplied by Q_i^T (into the eigenbasis), or by Q_i (back)."""
    for i, q in enumerate(qs):
        if q is not None:
            x = jnp.moveaxis(jnp.tensordot(x, q.T if back else q, axes=([i], [0])), -1, i)
    return x


def _gram(g: jax.Array, i: int) -> jax.Array:
    """G_(i) G_(i)^T: the product of g with itself over every dimension but i."""
    others = [j for j in range(g.ndim) if j != i]
    return jnp.tensordot(g, g, axes=(others, others))


def _on_every_device(fn: Callable) -> Callable:
    """fn run whole on each device of the current mesh (its arguments gathered), or as it is outside a mesh.

    Under SPMD, XLA cuts the Gram and rotation contractions of a sharded parameter into partial sums and an
    all-reduce, whose order of addition differs from one device's: the factors then differ in their last bits, and
    eigh's basis of a degenerate eigenspace (the first steps' factors are of low rank) follows those bits. Run
    whole, the update is the same bits on any mesh, and so is a run resumed on another one.
    """
    mesh = nt.current_mesh()
    if mesh is None:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False)


class SoapState(NamedTuple):
    """State of `scale_by_soap`: call count, the moments (parameter layout), the factors L and eigenbases Q."""

    count: jax.Array
    mu: PyTree
    nu: PyTree
    factors: PyTree
    """Per parameter, a tuple over the block's dimensions of (B, d, d) arrays, None where unfactored."""
    bases: PyTree
    """The eigenvectors of `factors`, the same structure."""


def scale_by_soap(
    *,
    b1: float = 0.95,
    b2: float = 0.95,
    shampoo_beta: float = 0.95,
    eps: float = 1e-8,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    merge_small_dims: bool = True,
    target_merged_dim_size: int = 2048,
    partition_grads_into_blocks: bool = True,
    block_size: int = 256,
) -> optax.GradientTransformation:
    """SOAP's direction (no learning rate); see the module doc for the update."""
    single_threaded_blas()  # its eigh runs LAPACK on XLA's threads (lm_train.optim.cpu_lapack)

    def layout(leaf: Any) -> BlockLayout:
        return block_layout(
            leaf,
            max_precond_dim=max_precond_dim,
            merge_small_dims=merge_small_dims,
            target_merged_dim_size=target_merged_dim_size,
            partition_grads_into_blocks=partition_grads_into_blocks,
            block_size=block_size,
        )

    def init(params: PyTree) -> SoapState:
        flat, _ = leaves(params)
        factors = []
        for p in flat:
            lay = layout(p)
            factors.append(
                tuple(
                    jnp.zeros((lay.count, d, d), raw(p).dtype) if f else None
                    for d, f in zip(lay.block, lay.factored, strict=True)
                )
            )
        zeros = lambda: jax.tree_util.tree_map(jnp.zeros_like, params)  # noqa: E731
        return SoapState(jnp.zeros((), jnp.int32), zeros(), zeros(), factors, [tuple(f) for f in factors])

    def leaf_update(g: jax.Array, mu: jax.Array, nu: jax.Array, factors: tuple, bases: tuple, count: jax.Array):
        """One parameter's (direction, mu, nu, factors, bases), all as (B, *block) blocks."""
        t = jnp.maximum(count, 1).astype(jnp.float32)  # steps that moved the parameters, this one included

        def one(g, mu, nu, bases):
            mu_new = b1 * mu + (1.0 - b1) * g
            nu_new = b2 * nu + (1.0 - b2) * jnp.square(_rotate(g, bases, back=False))
            adam = (_rotate(mu_new, bases, back=False) / (1.0 - b1**t)) / (jnp.sqrt(nu_new / (1.0 - b2**t)) + eps)
            return _rotate(adam, bases, back=True), mu_new, nu_new

        direction, mu_new, nu_new = jax.vmap(one)(g, mu, nu, bases)
        # The first call only starts the factors: no step, no moment.
        started = count > 0
        direction = jnp.where(started, direction, 0.0)
        mu_new, nu_new = jnp.where(started, mu_new, mu), jnp.where(started, nu_new, nu)
        factors = tuple(
            None if f is None else shampoo_beta * f + (1.0 - shampoo_beta) * jax.vmap(_gram, (0, None))(g, i)
            for i, f in enumerate(factors)
        )
        if any(f is not None for f in factors):  # else plain Adam: nothing to refresh
            bases = jax.lax.cond(
                count % precondition_frequency == 0,
                lambda fs, _: tuple(None if f is None else eigenvectors(f) for f in fs),
                lambda _, qs: qs,
                factors,
                bases,
            )
        return direction, mu_new, nu_new, factors, bases

    def update(updates: PyTree, state: SoapState, params: PyTree = None) -> tuple[PyTree, SoapState]:
        del params
        flat_g, treedef = leaves(updates)
        flat_mu, flat_nu = leaves(state.mu)[0], leaves(state.nu)[0]
        out, mus, nus, new_factors, new_bases = [], [], [], [], []
        for g_leaf, mu_leaf, nu_leaf, factors, bases in zip(
            flat_g, flat_mu, flat_nu, state.factors, state.bases, strict=True
        ):
            lay = layout(g_leaf)

            def whole(g, mu, nu, factors, bases, count, lay=lay):
                blocks = [lay.to_blocks(x) for x in (g, mu, nu)]
                direction, mu_b, nu_b, factors, bases = leaf_update(*blocks, factors, bases, count)
                back = [
                    lay.from_blocks(r, x.shape).astype(x.dtype) for r, x in ((direction, g), (mu_b, mu), (nu_b, nu))
                ]
                return (*back, factors, bases)

            arrays = [raw(x) for x in (g_leaf, mu_leaf, nu_leaf)]
            direction, mu, nu, factors, bases = _on_every_device(whole)(*arrays, factors, bases, state.count)
            for array, like, into in ((direction, g_leaf, out), (mu, mu_leaf, mus), (nu, nu_leaf, nus)):
                into.append(nt.NamedArray(array, like.axes) if nt.is_named(like) else array)
            new_factors.append(factors)
            new_bases.append(bases)
        unflatten = lambda xs: jax.tree_util.tree_unflatten(treedef, xs)  # noqa: E731
        new_state = SoapState(state.count + 1, unflatten(mus), unflatten(nus), new_factors, new_bases)
        return unflatten(out), new_state

    return optax.GradientTransformation(init, update)


def soap(
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    **settings: Any,
) -> optax.GradientTransformation:
    """SOAP with decoupled weight decay on the parameters `mask` selects; `settings` go to `scale_by_soap`."""
    parts = [scale_by_soap(**settings)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
