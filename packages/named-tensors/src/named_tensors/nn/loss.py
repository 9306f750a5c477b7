"""Cross-entropy over a named vocabulary axis, with masking, z-loss and reductions."""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

from .. import _ops as ops
from .._core import Axis, AxisSelector, NamedArray, axis_name, permute

Reduction = Literal["mean", "sum"] | None


def check_targets(targets: NamedArray, Vocab: AxisSelector, fn: str) -> None:
    """Raise unless targets is an integer NamedArray without the vocab axis."""
    if not isinstance(targets, NamedArray) or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"{fn}: targets must be an integer NamedArray of token ids, got {targets!r}")
    if targets.has_axis(axis_name(Vocab)):
        raise ValueError(f"{fn}: targets must not have the vocab axis {axis_name(Vocab)!r}")


def loss_from_logsumexp(
    logsumexp: NamedArray,
    target_logit: NamedArray,
    targets: NamedArray,
    vocab_size: int,
    *,
    mask: NamedArray | None,
    reduction: Reduction,
    z_loss_weight: float,
    fn: str,
) -> NamedArray:
    """Per-token loss lse - logit[target] + z * lse², masked and reduced.

    A target outside [0, vocab) at an unmasked position gives NaN (nothing can raise under jit); masked
    positions contribute exactly 0, whatever their target (e.g. -100).
    """
    if reduction not in ("mean", "sum", None):
        raise ValueError(f"{fn}: reduction must be 'mean', 'sum' or None, got {reduction!r}")
    loss = logsumexp - target_logit
    if z_loss_weight:
        loss = loss + z_loss_weight * ops.square(logsumexp)
    in_range = (targets >= 0) & (targets < vocab_size)
    loss = ops.where(in_range, loss, jnp.nan)
    if mask is None:
        weights = None
    else:
        if not isinstance(mask, NamedArray):
            raise TypeError(f"{fn}: mask must be a NamedArray (bool or float weights), got {type(mask).__name__}")
        extra = [n for n in mask.axis_names if not loss.has_axis(n)]
        if extra:
            raise ValueError(f"{fn}: mask has axes {extra} that the targets {loss.axis_names} do not have")
        weights = mask.broadcast_to(loss.axes).astype(jnp.float32)
        # where, not multiply: a masked NaN (bad target) must not poison the sum.
        loss = ops.where(weights != 0, loss * weights, 0.0)
    if reduction is None:
        return loss
    total = ops.sum(loss)
    if reduction == "sum":
        return total
    count = ops.sum(weights) if weights is not None else NamedArray(jnp.float32(loss.size), ())
    # With no unmasked token the mean is 0, computed through a safe denominator so gradients stay finite.
    return total / ops.where(count > 0, count, 1.0)


def cross_entropy_loss(
    logits: NamedArray,
    Vocab: AxisSelector,
    targets: NamedArray,
    *,
    mask: NamedArray | None = None,
    reduction: Reduction = "mean",
    z_loss_weight: float = 0.0,
) -> NamedArray:
    """Softmax cross-entropy of integer targets under logits over Vocab, computed in float32.

    mask: bool (or float weights) over the targets' axes; "mean" divides by the number (total weight) of
    unmasked tokens. z-loss adds z_loss_weight * logsumexp(logits)² per token. reduction None returns the
    per-token loss (0 where masked).
    """
    fn = "cross_entropy_loss"
    if not isinstance(logits, NamedArray):
        raise TypeError(f"{fn}: logits must be a NamedArray, got {type(logits).__name__}")
    V: Axis = logits.resolve_axis(Vocab)
    check_targets(targets, V, fn)
    other = [a for a in logits.axes if a.name != V.name]
    if {a.name for a in other} != set(targets.axis_names):
        raise ValueError(
            f"{fn}: targets axes {targets.axis_names} must be the logits' axes without {V.name!r} "
            f"({[a.name for a in other]})"
        )
    logits32 = permute(logits, (*targets.axis_names, V.name)).astype(jnp.float32)
    lse = ops.logsumexp(logits32, V)
    safe = jnp.clip(targets.array, 0, V.size - 1)
    picked = jnp.take_along_axis(logits32.array, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    target_logit = NamedArray(picked, targets.axes)
    return loss_from_logsumexp(
        lse, target_logit, targets, V.size, mask=mask, reduction=reduction, z_loss_weight=z_loss_weight, fn=fn
    )
