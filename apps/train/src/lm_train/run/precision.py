"""Mixed precision: jmp policies from config strings, and a checkpointable dynamic loss scale for fp16."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp

from lm_train.errors import ConfigError

AUTO = "auto"
ACCELERATOR_POLICY = "p=f32,c=bfloat16"


def resolve_mp(text: str, platform: str | None = None) -> str:
    """trainer.mp as a jmp policy string: `auto` is f32 on CPU and p=f32,c=bfloat16 on GPU and TPU (`platform`:
    the devices the run is for; default: those present)."""
    if text != AUTO:
        return text
    return "f32" if (platform or jax.default_backend()) == "cpu" else ACCELERATOR_POLICY


def with_resolved_mp(config: Any, platform: str | None = None) -> Any:
    """A TrainLmConfig with `trainer.mp: auto` replaced by the policy it means on `platform` (default: here)."""
    mp = resolve_mp(config.trainer.mp, platform)
    if mp == config.trainer.mp:
        return config
    return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, mp=mp))


def parse_policy(text: str, platform: str | None = None) -> jmp.Policy:
    """`p=f32,c=bfloat16`, `bfloat16`, `f32`, `auto` ... -> a jmp Policy, or a ConfigError naming trainer.mp."""
    try:
        return jmp.get_policy(resolve_mp(text, platform))
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise ConfigError(
            f"trainer.mp: cannot read precision policy {text!r} ({e}). Write e.g. `f32`, `bfloat16`, "
            "`p=f32,c=bfloat16` (params f32, compute bf16), `p=f32,c=float16` (with loss scaling) or `auto`."
        ) from None


def needs_loss_scaling(policy: jmp.Policy) -> bool:
    """fp16 compute needs loss scaling; bf16 and f32 do not."""
    return jnp.dtype(policy.compute_dtype) == jnp.float16


class LossScale(eqx.Module):
    """Dynamic loss scale whose whole state (min_loss_scale included) survives tree round trips."""

    scale: jax.Array
    counter: jax.Array
    enabled: bool = eqx.field(static=True, default=True)
    period: int = eqx.field(static=True, default=2000)
    factor: float = eqx.field(static=True, default=2.0)
    min_scale: float = eqx.field(static=True, default=1.0)

    @staticmethod
    def create(enabled: bool, initial: float = 2.0**15, period: int = 2000) -> LossScale:
        """A loss scale, or a disabled one (scale 1) for bf16/f32 runs."""
        start = initial if enabled else 1.0
        return LossScale(jnp.asarray(start, jnp.float32), jnp.zeros((), jnp.int32), enabled, period)

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        return loss * self.scale.astype(loss.dtype) if self.enabled else loss

    def unscale(self, tree: Any) -> Any:
        if not self.enabled:
            return tree
        inverse = 1.0 / self.scale
        return jax.tree_util.tree_map(lambda g: g * inverse.astype(g.dtype), tree)

    def adjust(self, grads_finite: jax.Array) -> LossScale:
        """Grow the scale after `period` finite steps; shrink it (not below min_scale) on overflow."""
        if not self.enabled:
            return self
        grown = jnp.where(self.counter == self.period - 1, self.scale * self.factor, self.scale)
        grown = jnp.where(jnp.isfinite(grown), grown, self.scale)
        shrunk = jnp.maximum(self.scale / self.factor, jnp.float32(self.min_scale))
        scale = jnp.where(grads_finite, grown, shrunk)
        counter = jnp.where(grads_finite, (self.counter + 1) % self.period, jnp.zeros_like(self.counter))
        return LossScale(scale, counter, self.enabled, self.period, self.factor, self.min_scale)


def all_finite(tree: Any) -> jax.Array:
    """Whether every leaf of a tree is finite (a scalar bool)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree) if eqx.is_inexact_array(x)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
