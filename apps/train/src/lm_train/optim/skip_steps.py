"""Skipping bad steps: a rolling window of gradient norms, and the decision whether this step's norm is an outlier.

A step is skipped when its gradient norm (or loss) is non-finite, or, once the window holds at least half its
length (and two) norms, when the norm exceeds median + sigma_factor * max(1.4826 * MAD, 1e-6) of the window:
the median absolute deviation is a robust estimate of sigma that one earlier spike cannot inflate. Every finite
norm enters the window, skipped or not, so that a lasting change of scale is taken after half a window.
Everything is jnp inside the step (no host round trip), and the window is part of the checkpointed state.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from lm_train.config.optimizer_config import SkipStepConfig

# 1.4826 * MAD estimates the standard deviation of normally distributed values.
MAD_TO_SIGMA = 1.4826
MIN_SIGMA = 1e-6


class SkipWindow(eqx.Module):
    """The recent gradient norms (a ring buffer), how many it holds, where the next goes, and the steps skipped."""

    grad_norms: jax.Array
    """float32[rolling_interval_length]; only the first `count` slots written so far are valid."""
    count: jax.Array
    """Number of valid norms, up to the window's length (int32)."""
    index: jax.Array
    """Slot of the next norm (int32)."""
    skipped: jax.Array
    """Steps skipped so far in the run (int32)."""


def init_window(config: SkipStepConfig) -> SkipWindow:
    """An empty window."""
    zero = jnp.zeros((), jnp.int32)
    return SkipWindow(jnp.zeros((config.rolling_interval_length,), jnp.float32), zero, zero, zero)


def _median(values: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.nanmedian(jnp.where(valid, values, jnp.nan))


def judge_step(
    window: SkipWindow, grad_norm: jax.Array, loss: jax.Array, config: SkipStepConfig
) -> tuple[jax.Array, SkipWindow, dict[str, jax.Array]]:
    """(whether to take the step, the window with this step's norm, metrics) for a step's gradient norm and loss."""
    size = window.grad_norms.shape[0]
    norm = grad_norm.astype(jnp.float32)
    valid = jnp.arange(size) < window.count
    median = _median(window.grad_norms, valid)
    sigma = jnp.maximum(MAD_TO_SIGMA * _median(jnp.abs(window.grad_norms - median), valid), MIN_SIGMA)
    threshold = median + config.sigma_factor * sigma
    judged = window.count >= max(2, size // 2)
    finite = jnp.isfinite(norm) & jnp.isfinite(loss)
    take = finite & ~(judged & (norm > threshold))
    grad_norms = jnp.where(finite, window.grad_norms.at[window.index].set(norm), window.grad_norms)
    new_window = SkipWindow(
        grad_norms=grad_norms,
        count=jnp.where(finite, jnp.minimum(window.count + 1, size), window.count),
        index=jnp.where(finite, (window.index + 1) % size, window.index),
        skipped=window.skipped + (~take).astype(jnp.int32),
    )
    metrics = {
        "optim/skipped_step": (~take).astype(jnp.float32),
        "optim/skipped_steps": new_window.skipped,
        "optim/skip_step/grad_norm_threshold": jnp.where(judged, threshold, jnp.inf),
    }
    return take, new_window, metrics
