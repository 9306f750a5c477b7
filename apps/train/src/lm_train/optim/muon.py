"""Muon (Jordan et al., 2024): momentum orthogonalised by Newton-Schulz for Linear weights, AdamW for the rest.

The update of a Linear weight W, seen as a matrix of shape (Out, In) (its Out axes flattened into one, its In axes
into another; any other axis, such as the stacked `layers`, is a batch of matrices):

    B_t = momentum * B_{t-1} + G_t
    D_t = momentum * B_t + G_t        (Nesterov; else D_t = B_t)
    O_t = NS(D_t / (||D_t||_F + eps)) * scale          scale = sqrt(max(1, Out / In)), or 0.2 * sqrt(max(Out, In))
    W_{t+1} = W_t - lr_t * (O_t + weight_decay * mask * W_t)

NS is `steps` iterations of X <- a X + (b A + c A A) X with A = X X^T, on the wide orientation of X (the
transpose when Out > In). Which parameters get Muon is decided by structure and axis names, as Levanter decides it
by module type and path: the `weight` of every `named_tensors.nn.Linear` whose axes name neither `vocab` nor
`position` (so no embedding table and no LM head); biases, norms, embeddings, heads and every other array get
AdamW at `adam_lr`, with the same schedule shape.

Sharding: under FSDP and tensor parallelism each matrix is gathered (its matrix axes replicated, any batch axis
kept as mapped) before the iteration, which then runs whole on every device. A distributed Newton-Schulz would
shard the three matmuls of each iteration and pay a collective for each (15 for 5 steps, all on the critical
path), for matrices that are at most a few thousand wide; one gather costs a single all-gather, and the result
is the same bits on any mesh, so a run resumed on another number of devices takes the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import named_tensors as nt
from named_tensors.nn import Linear

PyTree = Any

# Keller Jordan's quintic coefficients (modded-nanogpt; Levanter's "quintic" and its default).
QUINTIC = (3.4445, -4.7750, 2.0315)

MUON, ADAMW = "muon", "adamw"
_EMBEDDING_AXES = frozenset({"vocab", "position"})


def newton_schulz(x: jax.Array, steps: int, coefficients: tuple[float, float, float], eps: float) -> jax.Array:
    """The orthogonalisation of one matrix: `steps` Newton-Schulz iterations from x / (||x||_F + eps)."""
    a, b, c = coefficients
    x = x / (jnp.linalg.norm(x) + eps)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    # HIGHEST: on accelerators the default matmul precision is bf16, which the iteration's cancellations amplify.
    mm = lambda p, q: jnp.matmul(p, q, precision=jax.lax.Precision.HIGHEST)  # noqa: E731
    for _ in range(steps):
        gram = mm(x, x.T)
        x = a * x + mm(b * gram + c * mm(gram, gram), x)
    return x.T if transposed else x


def _gathered(x: jax.Array, batch_axes: tuple[nt.Axis, ...]) -> jax.Array:
    """x (batch..., out, in) with its two matrix dimensions replicated on the current mesh (see the module doc)."""
    mesh, mapping = nt.current_mesh(), nt.current_axis_mapping()
    if mesh is None:
        return x
    batch_spec = tuple(nt.partition_spec(batch_axes, mapping, mesh)) if mapping else (None,) * len(batch_axes)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*batch_spec, None, None)))


def orthogonalize(
    weight: nt.NamedArray,
    In: tuple[nt.Axis, ...],
    Out: tuple[nt.Axis, ...],
    *,
    steps: int,
    coefficients: tuple[float, float, float],
    eps: float,
    kimi_scaling: bool = False,
) -> nt.NamedArray:
    """Muon's direction for a Linear weight: each (Out, In) matrix orthogonalised and scaled, other axes batched."""
    matrix_names = {a.name for a in (*Out, *In)}
    batch = tuple(a for a in weight.axes if a.name not in matrix_names)
    order = (*batch, *Out, *In)
    x = nt.permute(weight, [a.name for a in order]).array
    rows, cols = math.prod(a.size for a in Out), math.prod(a.size for a in In)
    x = _gathered(x.reshape(*(a.size for a in batch), rows, cols), batch)

    def one(m: jax.Array) -> jax.Array:
        return newton_schulz(m, steps, coefficients, eps)

    for _ in batch:
        one = jax.vmap(one)
    scale = 0.2 * math.sqrt(max(rows, cols)) if kimi_scaling else math.sqrt(max(1.0, rows / cols))
    out = (one(x.astype(jnp.float32)) * scale).astype(weight.array.dtype)
    return nt.permute(nt.NamedArray(out.reshape(tuple(a.size for a in order)), order), weight.axis_names)


def _is_linear(x: Any) -> bool:
    return isinstance(x, Linear)


def muon_labels(params: PyTree) -> PyTree:
    """A prefix tree of `params` labelling each parameter "muon" (Linear weights, not embeddings/heads) or "adamw"."""

    def label(x: Any) -> Any:
        if _is_linear(x):
            weight = x.weight
            takes_muon = nt.is_named(weight) and not (set(weight.axis_names) & _EMBEDDING_AXES)
            weight_label = None if weight is None else MUON if takes_muon else ADAMW
            return Linear(weight_label, None if x.bias is None else ADAMW, x.In, x.Out)
        return None if x is None else ADAMW

    return jax.tree_util.tree_map(label, params, is_leaf=lambda x: _is_linear(x) or nt.is_named(x) or x is None)


class MuonState(NamedTuple):
    """State of `scale_by_muon`: the momentum buffer of the Muon parameters."""

    momentum_buffer: PyTree


def scale_by_muon(
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    steps: int = 5,
    coefficients: tuple[float, float, float] = QUINTIC,
    eps: float = 1e-8,
    kimi_scaling: bool = False,
) -> optax.GradientTransformation:
    """Muon's direction (no learning rate) for a tree of Linear layers whose weights it updates."""

    def init(params: PyTree) -> MuonState:
        return MuonState(jax.tree_util.tree_map(jnp.zeros_like, params))

    def update(updates: PyTree, state: MuonState, params: PyTree = None) -> tuple[PyTree, MuonState]:
        del params
        buffer = jax.tree_util.tree_map(lambda b, g: momentum * b + g.astype(b.dtype), state.momentum_buffer, updates)
        if nesterov:
            direction = jax.tree_util.tree_map(lambda b, g: momentum * b + g.astype(b.dtype), buffer, updates)
        else:
            direction = buffer

        def transform(x: Any) -> Any:
            if _is_linear(x) and nt.is_named(x.weight):
                orthogonal = orthogonalize(
                    x.weight, x.In, x.Out, steps=steps, coefficients=coefficients, eps=eps, kimi_scaling=kimi_scaling
                )
                return Linear(orthogonal, x.bias, x.In, x.Out)
            return x

        direction = jax.tree_util.tree_map(transform, direction, is_leaf=_is_linear)
        direction = jax.tree_util.tree_map(lambda d, g: d.astype(g.dtype), direction, updates)
        return direction, MuonState(buffer)

    return optax.GradientTransformation(init, update)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    adam_learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    steps: int = 5,
    coefficients: tuple[float, float, float] = QUINTIC,
    muon_eps: float = 1e-8,
    kimi_scaling: bool = False,
    beta1: float = 0.9,
    beta2: float = 0.95,
    epsilon: float = 1e-8,
    weight_decay: float = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    adam_max_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    """Muon on Linear weights and AdamW on every other parameter (see `muon_labels`), each with decoupled decay.

    `adam_max_grad_norm` clips the AdamW parameters' gradients by their global norm, as Levanter does; the Muon
    parameters are not clipped (Newton-Schulz normalises their step anyway).
    """
    muon_part = [
        scale_by_muon(
            momentum=momentum,
            nesterov=nesterov,
            steps=steps,
            coefficients=coefficients,
            eps=muon_eps,
            kimi_scaling=kimi_scaling,
        )
    ]
    adam_part = [optax.clip_by_global_norm(adam_max_grad_norm)] if adam_max_grad_norm else []
    adam_part.append(optax.scale_by_adam(b1=beta1, b2=beta2, eps=epsilon))
    for part, lr in ((muon_part, learning_rate), (adam_part, adam_learning_rate)):
        if weight_decay:
            part.append(optax.add_decayed_weights(weight_decay, mask))
        part.append(optax.scale_by_learning_rate(lr))
    return optax.multi_transform({MUON: optax.chain(*muon_part), ADAMW: optax.chain(*adam_part)}, muon_labels)
