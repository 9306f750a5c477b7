"""The train step: loss and gradients (with microbatches), the optimizer's hooks, the update, its metrics."""

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
import trackers
from lm_models import next_token_loss, next_token_targets
from lm_train.optim import HessianObjective, Optimizer
from lm_train.precision import LossScale, all_finite
from lm_train.state import PURPOSE_DROPOUT, PURPOSE_HESSIAN, TrainerState, step_key

Metrics = dict[str, jax.Array]
WatchFn = Callable[..., None]
"""Called inside the step as watch(step=, grads=, params=, updates=, opt_state=); it logs through jit_log."""


@dataclass(frozen=True)
class StepSettings:
    """Static settings of the train step (they are part of the compiled program)."""

    policy: jmp.Policy
    microbatches: int
    z_loss_weight: float
    batch_axis: str = "batch"


def _split_microbatches(input_ids: nt.NamedArray, n: int, batch_axis: str) -> nt.NamedArray:
    # Example j*n + i goes to microbatch i: each device's contiguous block of the batch then holds a
    # share of every microbatch, so microbatches stay spread over the data axis.
    Batch = input_ids.resolve_axis(batch_axis)
    ids = nt.permute(input_ids, (batch_axis, ...))
    per = Batch.size // n
    arr = ids.array.reshape((per, n, *ids.array.shape[1:]))
    axes = (Batch.resize(per), nt.Axis("microbatch", n), *ids.axes[1:])
    return nt.shard(nt.NamedArray(arr, axes))


def micro_first(input_ids: nt.NamedArray, settings: StepSettings) -> nt.NamedArray:
    """The first microbatch (the whole batch without accumulation): second-order estimates use it alone."""
    if settings.microbatches == 1:
        return input_ids
    return _split_microbatches(input_ids, settings.microbatches, settings.batch_axis)["microbatch", 0]


def make_train_step(
    optimizer: Optimizer,
    settings: StepSettings,
    learning_rate: Callable[[jax.Array], jax.Array],
    watch: WatchFn | None = None,
    prepare_model: Callable[[Any], Any] | None = None,
) -> Callable[[TrainerState, nt.NamedArray], tuple[TrainerState, Metrics]]:
    """A function (state, input_ids) -> (new state, metrics); jit it with donation.

    prepare_model, if given, maps the compute-dtype model before the loss sees it (`lm-train plan` stands in
    FSDP's all-gathers with it when it traces one device's share of the step).
    """
    policy = settings.policy

    def loss_of(params: Any, static: Any, ids: nt.NamedArray, key: jax.Array, scale: LossScale) -> jax.Array:
        model = policy.cast_to_compute(eqx.combine(params, static))
        if prepare_model is not None:
            model = prepare_model(model)
        loss = next_token_loss(model, ids, key=key, z_loss_weight=settings.z_loss_weight)
        loss = loss.array if isinstance(loss, nt.NamedArray) else loss
        return scale.scale_loss(loss.astype(jnp.float32))

    grad_fn = jax.value_and_grad(loss_of)

    def loss_and_grads(state: TrainerState, params: Any, static: Any, input_ids: nt.NamedArray, key: jax.Array):
        if settings.microbatches == 1:
            return grad_fn(params, static, nt.shard(input_ids), key, state.loss_scale)
        micro = nt.permute(
            _split_microbatches(input_ids, settings.microbatches, settings.batch_axis), ("microbatch", ...)
        )

        def accumulate(carry, xs):
            loss_sum, grad_sum = carry
            ids_array, micro_key = xs
            ids = nt.shard(nt.NamedArray(ids_array, micro.axes[1:]))
            loss, grads = grad_fn(params, static, ids, micro_key, state.loss_scale)
            return (loss_sum + loss, jax.tree_util.tree_map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        keys = jax.random.split(key, settings.microbatches)
        (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), (micro.array, keys))
        n = settings.microbatches
        return loss / n, jax.tree_util.tree_map(lambda g: g / n, grads)

    def hessian_objective(static: Any, ids: nt.NamedArray, state: TrainerState, key: jax.Array) -> HessianObjective:
        def model_of(p: Any) -> Any:
            return policy.cast_to_compute(eqx.combine(p, static))

        def loss(p: Any) -> jax.Array:
            return next_token_loss(model_of(p), ids, key=key).array.astype(jnp.float32)

        _, not_last = next_token_targets(ids)
        return HessianObjective(
            loss, lambda p: model_of(p)(ids, key=key), not_last, step_key(state.key, state.step, PURPOSE_HESSIAN)
        )

    def train_step(state: TrainerState, input_ids: nt.NamedArray) -> tuple[TrainerState, Metrics]:
        # Model and loss code may call trackers.jit_log(metrics) without a step: it logs at this step's number.
        with trackers.logging_step(state.step + 1):
            return _train_step(state, input_ids)

    def _train_step(state: TrainerState, input_ids: nt.NamedArray) -> tuple[TrainerState, Metrics]:
        params, static = eqx.partition(state.model, eqx.is_inexact_array)
        dropout_key = step_key(state.key, state.step, PURPOSE_DROPOUT)
        loss, grads = loss_and_grads(state, params, static, input_ids, dropout_key)
        opt_state = state.opt_state
        if optimizer.hessian_update is not None:
            objective = hessian_objective(static, nt.shard(micro_first(input_ids, settings)), state, dropout_key)
            opt_state = optimizer.hessian_update(opt_state, params, objective)
        grads = state.loss_scale.unscale(grads)
        loss = loss / state.loss_scale.scale if state.loss_scale.enabled else loss
        finite = all_finite(grads)
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
        if watch is not None:
            watch(step=state.step + 1, grads=grads, params=params, updates=updates, opt_state=opt_state)
        metrics = {
            "train/loss": loss,
            "optim/grad_norm": optax.tree.norm(grads),
            "optim/learning_rate": learning_rate_now,
            "optim/grads_finite": finite,
        }
        if state.loss_scale.enabled:
            metrics["optim/loss_scale"] = state.loss_scale.scale
        if optimizer.metrics is not None:
            metrics.update(optimizer.metrics(new_opt_state))
        new_state = TrainerState(
            step=state.step + 1,
            model=eqx.combine(new_params, static),
            opt_state=new_opt_state,
            key=state.key,
            loss_scale=state.loss_scale.adjust(finite),
        )
        return new_state, metrics

    return train_step
