"""The trainer state and the jit-compiled train and eval steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import optax

import named_tensors as nt
from lm_models import inference_mode, next_token_loss, next_token_targets
from lm_train import sophia
from lm_train.precision import LossScale, all_finite

# Purposes of random draws: the key of a draw is fold_in(fold_in(run key, step), purpose).
PURPOSE_DROPOUT = 1
PURPOSE_HESSIAN = 2


class TrainerState(eqx.Module):
    """Everything a resumed run needs, as one pytree: step, model, optimizer state, key, loss scale."""

    step: jax.Array
    model: Any
    opt_state: Any
    key: jax.Array
    """The run's base PRNG key, as raw uint32 key data (checkpointable)."""
    loss_scale: LossScale


def step_key(base_key: jax.Array, step: jax.Array, purpose: int) -> jax.Array:
    """The key of one draw, a pure function of (run key, step, purpose)."""
    key = jax.random.wrap_key_data(base_key)
    return jax.random.fold_in(jax.random.fold_in(key, step), purpose)


def trainable(model: Any) -> Any:
    """The floating-point arrays of a model: what the optimizer updates."""
    return eqx.filter(model, eqx.is_inexact_array)


@dataclass(frozen=True)
class StepSettings:
    """Static settings of the train step (they are part of the compiled program)."""

    policy: jmp.Policy
    microbatches: int
    z_loss_weight: float
    batch_axis: str = "batch"
    hessian_estimator: str | None = None
    """Sophia's estimator of the Hessian diagonal (`hutchinson` or `gauss_newton_bartlett`), else None."""


def _split_microbatches(input_ids: nt.NamedArray, n: int, batch_axis: str) -> nt.NamedArray:
    # Example j*n + i goes to microbatch i: each device's contiguous block of the batch then holds a
    # share of every microbatch, so microbatches stay spread over the data axis.
    Batch = input_ids.resolve_axis(batch_axis)
    ids = nt.permute(input_ids, (batch_axis, ...))
    per = Batch.size // n
    arr = ids.array.reshape((per, n, *ids.array.shape[1:]))
    axes = (Batch.resize(per), nt.Axis("microbatch", n), *ids.axes[1:])
    return nt.shard(nt.NamedArray(arr, axes))


def make_train_step(
    optimizer: optax.GradientTransformation,
    settings: StepSettings,
    learning_rate: Callable[[jax.Array], jax.Array],
) -> Callable[[TrainerState, nt.NamedArray], tuple[TrainerState, dict[str, jax.Array]]]:
    """A function (state, input_ids) -> (new state, metrics); jit it with donation."""
    policy = settings.policy

    def loss_of(params: Any, static: Any, ids: nt.NamedArray, key: jax.Array, scale: LossScale) -> jax.Array:
        model = policy.cast_to_compute(eqx.combine(params, static))
        loss = next_token_loss(model, ids, key=key, z_loss_weight=settings.z_loss_weight)
        loss = loss.array if isinstance(loss, nt.NamedArray) else loss
        return scale.scale_loss(loss.astype(jnp.float32))

    grad_fn = jax.value_and_grad(loss_of)

    def train_step(state: TrainerState, input_ids: nt.NamedArray) -> tuple[TrainerState, dict[str, jax.Array]]:
        params, static = eqx.partition(state.model, eqx.is_inexact_array)
        dropout_key = step_key(state.key, state.step, PURPOSE_DROPOUT)
        if settings.microbatches == 1:
            loss, grads = grad_fn(params, static, nt.shard(input_ids), dropout_key, state.loss_scale)
        else:
            micro = nt.permute(
                _split_microbatches(input_ids, settings.microbatches, settings.batch_axis), ("microbatch", ...)
            )
            keys = jax.random.split(dropout_key, settings.microbatches)

            def accumulate(carry, xs):
                loss_sum, grad_sum = carry
                ids_array, key = xs
                ids = nt.shard(nt.NamedArray(ids_array, micro.axes[1:]))
                loss, grads = grad_fn(params, static, ids, key, state.loss_scale)
                grad_sum = jax.tree_util.tree_map(jnp.add, grad_sum, grads)
                return (loss_sum + loss, grad_sum), None

            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), (micro.array, keys))
            loss = loss / settings.microbatches
            grads = jax.tree_util.tree_map(lambda g: g / settings.microbatches, grads)
        opt_state = state.opt_state
        if settings.hessian_estimator is not None:
            ids = micro_first(input_ids, settings) if settings.microbatches > 1 else input_ids
            opt_state = _refresh_hessian(settings, params, static, nt.shard(ids), state, opt_state, dropout_key)
        grads = state.loss_scale.unscale(grads)
        loss = loss / state.loss_scale.scale if state.loss_scale.enabled else loss
        finite = all_finite(grads)
        grad_norm = optax.tree.norm(grads)
        # optax mixes python floats and int32 step counts; it is not written for strict promotion.
        with jax.numpy_dtype_promotion("standard"):
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            learning_rate_now = learning_rate(state.step)
        new_params = nt.shard(new_params)
        if state.loss_scale.enabled:
            # A step whose gradients overflowed is skipped: parameters and optimizer state stay.
            new_params = jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new_params, params)
            new_opt_state = jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new_opt_state, state.opt_state)
        new_state = TrainerState(
            step=state.step + 1,
            model=eqx.combine(new_params, static),
            opt_state=new_opt_state,
            key=state.key,
            loss_scale=state.loss_scale.adjust(finite),
        )
        metrics = {
            "train/loss": loss,
            "optim/grad_norm": grad_norm,
            "optim/learning_rate": learning_rate_now,
            "optim/grads_finite": finite,
        }
        if state.loss_scale.enabled:
            metrics["optim/loss_scale"] = state.loss_scale.scale
        if settings.hessian_estimator is not None:
            metrics["optim/sophia_unclipped_fraction"] = sophia.unclipped_fraction(new_opt_state)
        return new_state, metrics

    return train_step


def micro_first(input_ids: nt.NamedArray, settings: StepSettings) -> nt.NamedArray:
    """The first microbatch: Sophia estimates the Hessian diagonal on it alone."""
    micro = _split_microbatches(input_ids, settings.microbatches, settings.batch_axis)
    return micro["microbatch", 0]


def _refresh_hessian(
    settings: StepSettings,
    params: Any,
    static: Any,
    ids: nt.NamedArray,
    state: TrainerState,
    opt_state: Any,
    dropout_key: jax.Array,
) -> Any:
    """Every k steps (the optimizer decides), fold a fresh estimate of the Hessian diagonal into Sophia's EMA."""
    policy = settings.policy
    hessian_key = step_key(state.key, state.step, PURPOSE_HESSIAN)

    def model_of(p: Any) -> Any:
        return policy.cast_to_compute(eqx.combine(p, static))

    if settings.hessian_estimator == "hutchinson":

        def loss(p: Any) -> jax.Array:
            value = next_token_loss(model_of(p), ids, key=dropout_key)
            return value.array.astype(jnp.float32)

        def estimate() -> Any:
            return sophia.hutchinson_diagonal(loss, params, hessian_key)

    else:
        _, not_last = next_token_targets(ids)

        def estimate() -> Any:
            return sophia.gauss_newton_bartlett_diagonal(
                lambda p: model_of(p)(ids, key=dropout_key), params, hessian_key, mask=not_last
            )

    return sophia.maybe_update_hessian(opt_state, lambda: nt.shard(estimate()))


def make_eval_step(policy: jmp.Policy) -> Callable[[Any, nt.NamedArray], jax.Array]:
    """A function (model, input_ids) -> summed next-token loss and token count, in inference mode."""

    def eval_step(model: Any, input_ids: nt.NamedArray) -> tuple[jax.Array, jax.Array]:
        model = policy.cast_to_compute(inference_mode(model))
        total = next_token_loss(model, nt.shard(input_ids), reduction="sum")
        total = total.array if isinstance(total, nt.NamedArray) else total
        Pos = input_ids.resolve_axis("position")
        count = input_ids.size // Pos.size * (Pos.size - 1)
        return total.astype(jnp.float32), jnp.asarray(count, jnp.float32)

    return eval_step
