"""What the train step knows of an optimizer: optax's init/update, plus two optional hooks.

`hessian_update(opt_state, params, objective)` lets a second-order optimizer refresh its curvature estimate from
the step's objective before `update` runs; `metrics(opt_state)` lets it report statistics of its own. The step
calls the hooks when they are set and knows no optimizer by name, so a new second-order method needs no change
to the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

import named_tensors as nt

PyTree = Any


class HessianObjective(NamedTuple):
    """The training objective at this step, as a second-order optimizer needs it."""

    loss: Callable[[PyTree], jax.Array]
    """Scalar loss of the trainable parameters on this step's (first micro)batch."""
    logits: Callable[[PyTree], nt.NamedArray]
    """The model's logits on the same batch."""
    target_mask: nt.NamedArray
    """Which positions of the batch have a next-token target (the last position has none)."""
    key: jax.Array
    """A key for the optimizer's own random draws at this step."""


class Optimizer(NamedTuple):
    """An optax GradientTransformation (duck-typed: init/update) with the step's optional hooks."""

    init: optax.TransformInitFn
    update: optax.TransformUpdateFn
    hessian_update: Callable[[PyTree, PyTree, HessianObjective], PyTree] | None = None
    metrics: Callable[[PyTree], dict[str, jax.Array]] | None = None


def with_hooks(transformation: Any) -> Optimizer:
    """An optax transformation as an Optimizer (keeping its hooks if it has them)."""
    if isinstance(transformation, Optimizer):
        return transformation
    return Optimizer(transformation.init, transformation.update)


def chain(*parts: Any) -> Optimizer:
    """optax.chain of the parts, whose hooks each act on their own part of the chained state."""
    inner = optax.chain(*parts)
    hooked = [with_hooks(p) for p in parts]
    hessian_hooks = [p.hessian_update for p in hooked]
    metric_hooks = [p.metrics for p in hooked]

    def hessian_update(state: tuple, params: PyTree, objective: HessianObjective) -> tuple:
        # optax.chain's state is the tuple of its parts' states, in order.
        return tuple(h(s, params, objective) if h else s for h, s in zip(hessian_hooks, state, strict=True))

    def metrics(state: tuple) -> dict[str, jax.Array]:
        out: dict[str, jax.Array] = {}
        for hook, s in zip(metric_hooks, state, strict=True):
            if hook is not None:
                out.update(hook(s))
        return out

    return Optimizer(
        inner.init,
        inner.update,
        hessian_update if any(hessian_hooks) else None,
        metrics if any(metric_hooks) else None,
    )
