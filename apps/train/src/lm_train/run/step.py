"""The train step: loss and gradients (with microbatches), the optimizer's hooks, the update, its metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import optax

import named_tensors as nt
import trackers
from lm_models import next_token_loss, next_token_targets
from lm_train.config.optimizer_config import SkipStepConfig
from lm_train.optim import HessianObjective, Optimizer
from lm_train.optim.skip_steps import judge_step
from lm_train.post.lora_training import split_trainable
from lm_train.run.batch import TokenBatch
from lm_train.run.context_parallel import context_size, load_balanced
from lm_train.run.model_averaging import ema_update
from lm_train.run.objectives import Objective, next_token_objective
from lm_train.run.pipeline import PipelineSchedule, pipeline_schedule, pipelined
from lm_train.run.precision import LossScale, all_finite, parse_policy
from lm_train.run.quantization import add_grads, combine_model, mean_grads, split_histories, split_seen
from lm_train.run.router_metrics import ROUTER_LOAD, balance_routing, router_load_metrics
from lm_train.run.state import PURPOSE_DROPOUT, PURPOSE_HESSIAN, TrainerState, step_key

if TYPE_CHECKING:
    from lm_train.config.schema import TrainLmConfig

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
    fcm_prob: float = 0.0
    ema_beta: float | None = None
    """Decay of the state's weight average (trainer.model_averaging); None: the state keeps none."""
    skip_steps: SkipStepConfig | None = None
    """optimizer.skip_bad_steps; None: the state keeps no window of gradient norms."""
    pipeline: PipelineSchedule | None = None
    """The layer stack's pipeline schedule (trainer.pipeline_axis_size > 1); None: the stack runs as one scan."""
    context_size: int = 1
    """Devices that split each sequence (trainer.context_axis_size); above 1 the batch is causally load-balanced."""
    microbatch_rows: int | None = None
    """Examples per accumulation microbatch, when a batch-size schedule accumulates (each size then has its own
    count of them); None: every batch has `microbatches`."""

    def microbatches_of(self, rows: int) -> int:
        """Accumulation microbatches of a global batch of `rows` examples."""
        return self.microbatches if self.microbatch_rows is None else rows // self.microbatch_rows

    @classmethod
    def of_config(cls, config: TrainLmConfig, microbatches: int, policy: jmp.Policy | None = None) -> StepSettings:
        """The settings a run's config gives: precision, z-loss, FCM, weight average and skipping of bad steps."""
        averaging = config.trainer.model_averaging
        schedule = config.trainer.batch_schedule
        several = schedule.fixed is None and microbatches > 1
        return cls(
            policy if policy is not None else parse_policy(config.trainer.mp),
            microbatches,
            config.z_loss_weight,
            config.trainer.batch_axis,
            config.fcm_prob,
            ema_beta=averaging.decay() if averaging is not None else None,
            skip_steps=getattr(config.optimizer, "skip_steps", None),
            pipeline=pipeline_schedule(config.trainer),
            context_size=context_size(config.trainer),
            microbatch_rows=schedule.largest // microbatches if several else None,
        )


def _split_microbatches(input_ids: nt.NamedArray, n: int, batch_axis: str) -> nt.NamedArray:
    # Example j*n + i goes to microbatch i: each device's contiguous block of the batch then holds a
    # share of every microbatch, so microbatches stay spread over the data axis.
    Batch = input_ids.resolve_axis(batch_axis)
    ids = nt.permute(input_ids, (batch_axis, ...))
    per = Batch.size // n
    arr = ids.array.reshape((per, n, *ids.array.shape[1:]))
    axes = (Batch.resize(per), nt.Axis("microbatch", n), *ids.axes[1:])
    return nt.shard(nt.NamedArray(arr, axes))


def _map_fields(batch: TokenBatch, fn: Callable[[nt.NamedArray], nt.NamedArray]) -> TokenBatch:
    return jax.tree_util.tree_map(fn, batch, is_leaf=nt.is_named)


def micro_first(batch: TokenBatch, settings: StepSettings) -> TokenBatch:
    """The first microbatch (the whole batch without accumulation): second-order estimates use it alone."""
    n, axis = settings.microbatches_of(batch.input_ids.resolve_axis(settings.batch_axis).size), settings.batch_axis
    if n == 1:
        return batch
    return _map_fields(batch, lambda x: _split_microbatches(x, n, axis)["microbatch", 0])


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


def _positions(attention: dict[str, Any]) -> dict[str, Any]:
    return {"positions": attention["positions"]} if "positions" in attention else {}


def make_train_step(
    optimizer: Optimizer,
    settings: StepSettings,
    learning_rate: Callable[[jax.Array], jax.Array],
    watch: WatchFn | None = None,
    objective: Objective | None = None,
    prepare_model: Callable[[Any], Any] | None = None,
) -> Callable[[TrainerState, TokenBatch], tuple[TrainerState, Metrics]]:
    """A function (state, batch) -> (new state, metrics); jit it with donation.

    `objective` is what is differentiated (default: the next-token loss with settings.z_loss_weight), called as
    `Objective` states with the state's frozen model and kind state; the metrics it returns are logged beside the
    loss, and the kind state it returns is the new state's. `prepare_model`, if given, maps the compute-dtype model
    before anything reads it (`lm-train plan` stands FSDP's all-gathers in with it when it traces one device's
    share of the step); without it the traced program is unchanged.
    """
    policy = settings.policy

    objective = objective or next_token_objective(settings.z_loss_weight, settings.fcm_prob)

    def compute_model(params: Any, static: Any) -> Any:
        model = policy.cast_to_compute(eqx.combine(params, static))
        if settings.pipeline is not None:
            model = pipelined(model, settings.pipeline, settings.batch_axis)
        return model if prepare_model is None else prepare_model(model)

    def loss_of(params: Any, static: Any, batch: TokenBatch, key: jax.Array, scale: LossScale, state: TrainerState):
        model = compute_model(params, static)
        frozen = state.frozen  # a kind's frozen model: compute dtype already, no gradients flow into it
        if frozen is not None and prepare_model is not None:
            frozen = prepare_model(frozen)
        loss, extra, kind_state = objective(model, batch, key, frozen, state.kind_state)
        return scale.scale_loss(loss), (extra, kind_state)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def loss_and_grads(state: TrainerState, params: Any, static: Any, batch: TokenBatch, key: jax.Array):
        n, axis = settings.microbatches_of(batch.input_ids.resolve_axis(settings.batch_axis).size), settings.batch_axis
        if n == 1:
            return grad_fn(params, static, _map_fields(batch, nt.shard), key, state.loss_scale, state)
        if state.kind_state is not None:
            raise ValueError("a kind with state updates it from the whole batch at once: set microbatches to 1")
        micro = _map_fields(batch, lambda x: nt.permute(_split_microbatches(x, n, axis), ("microbatch", ...)))

        def one_microbatch(arrays: TokenBatch) -> TokenBatch:
            # lax.scan hands each field's array without its leading `microbatch` axis: name its other axes again.
            return jax.tree_util.tree_map(
                lambda a, like: nt.shard(nt.NamedArray(a, like.axes[1:])), arrays, micro, is_leaf=_is_array
            )

        def accumulate(carry, xs):
            loss_sum, grad_sum = carry
            arrays, micro_key = xs
            micro_batch, scale = one_microbatch(arrays), state.loss_scale
            (loss, extra), grads = grad_fn(params, static, micro_batch, micro_key, scale, state)
            return (loss_sum + loss, add_grads(grad_sum, grads)), extra

        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        keys = jax.random.split(key, n)
        xs = (_map_fields(micro, lambda x: x.array), keys)
        (loss, grads), extras = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), xs)
        extra = jax.tree_util.tree_map(lambda v: jnp.mean(v, axis=0), extras[0]), None
        return (loss / n, extra), mean_grads(grads, n)

    def hessian_objective(static: Any, batch: TokenBatch, state: TrainerState, key: jax.Array) -> HessianObjective:
        def model_of(p: Any) -> Any:
            return compute_model(p, static)

        extra = batch.loss_inputs()

        def loss(p: Any) -> jax.Array:
            return next_token_loss(model_of(p), batch.input_ids, key=key, **extra).array.astype(jnp.float32)

        _, not_last = next_token_targets(batch.input_ids)
        mask = not_last if batch.loss_mask is None else not_last & batch.loss_mask
        if batch.targets is not None:  # reordered positions: the loss mask already leaves the last one out
            assert batch.loss_mask is not None  # context_parallel.load_balanced gives both or neither
            mask = batch.loss_mask
        attention = {k: v for k, v in extra.items() if k in ("attn_mask", "positions")}
        return HessianObjective(
            loss,
            lambda p: model_of(p)(batch.input_ids, attention.get("attn_mask"), key=key, **_positions(attention)),
            mask,
            step_key(state.key, state.step, PURPOSE_HESSIAN),
        )

    def train_step(state: TrainerState, batch: TokenBatch) -> tuple[TrainerState, Metrics]:
        # Model and loss code may call trackers.jit_log(metrics) without a step: it logs at this step's number.
        with trackers.logging_step(state.step + 1):
            return _train_step(state, batch)

    def _train_step(state: TrainerState, batch: TokenBatch) -> tuple[TrainerState, Metrics]:
        params, static = split_trainable(state.model)  # every float array; the adapters alone with LoRA
        # fp8 amax histories are differentiated beside the parameters: their "gradients" are the amaxes seen.
        histories, static = split_histories(static)
        differentiated = params if histories is None else eqx.combine(params, histories)
        if settings.context_size > 1:  # once per step, not per layer: each token takes its position id along
            batch = load_balanced(batch, settings.context_size)
        dropout_key = step_key(state.key, state.step, PURPOSE_DROPOUT)
        (loss, (objective_metrics, kind_state)), grads = loss_and_grads(
            state, differentiated, static, batch, dropout_key
        )
        grads, seen = split_seen(grads, histories)
        objective_metrics = dict(objective_metrics)
        load = objective_metrics.pop(ROUTER_LOAD, None)  # a mixture's expert loads (layers, experts), or None
        opt_state = state.opt_state
        if optimizer.hessian_update is not None:
            first = _map_fields(micro_first(batch, settings), nt.shard)
            objective = hessian_objective(static, first, state, dropout_key)
            opt_state = optimizer.hessian_update(opt_state, params, objective)
        grads = state.loss_scale.unscale(grads)
        loss = loss / state.loss_scale.scale if state.loss_scale.enabled else loss
        grad_norm = optax.tree.norm(grads)
        # Without loss scaling the flag is only a metric. A non-finite gradient makes the norm non-finite, so the
        # norm (computed anyway, for clipping and the log) answers it without another pass over every gradient;
        # it also reads false when the squares overflow f32 (a gradient above ~1e19). On a GPT-2-small-sized
        # model the extra pass was ~1.5% of a CPU step.
        finite = all_finite(grads) if state.loss_scale.enabled else jnp.isfinite(grad_norm)
        # optax mixes python floats and int32 step counts; it is not written for strict promotion.
        with jax.numpy_dtype_promotion("standard"):
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            learning_rate_now = learning_rate(state.step)
        new_params = nt.shard(new_params)
        new_params, balance_metrics = balance_routing(new_params, params, load)
        # Whether the update is taken: a step whose gradients overflowed under loss scaling, or that
        # optimizer.skip_bad_steps judges bad, is skipped. None: every step is taken, and nothing is selected.
        take = finite if state.loss_scale.enabled else None
        skip_window, skip_metrics = state.skip_window, {}
        if skip_window is not None:
            if settings.skip_steps is None:
                raise ValueError("the state keeps a window of gradient norms: give StepSettings.skip_steps")
            judged, skip_window, skip_metrics = judge_step(skip_window, grad_norm, loss, settings.skip_steps)
            take = judged if take is None else take & judged

        def keep_if_skipped(new: Any, old: Any, taken: jax.Array) -> Any:
            return jax.tree_util.tree_map(lambda n, o: jnp.where(taken, n, o), new, old)

        if take is not None:  # a skipped step leaves parameters, optimizer state and kind state as they were
            new_params = keep_if_skipped(new_params, params, take)
            new_opt_state = keep_if_skipped(new_opt_state, state.opt_state, take)
            kind_state = keep_if_skipped(kind_state, state.kind_state, take)
        averaged = state.averaged
        if averaged is not None:
            if settings.ema_beta is None:
                raise ValueError("the state keeps a weight average: give StepSettings.ema_beta")
            averaged = nt.shard(ema_update(averaged, new_params, settings.ema_beta))
            if take is not None:  # the weights did not move, and the average does not either
                averaged = keep_if_skipped(averaged, state.averaged, take)
        if watch is not None:
            watch(step=state.step + 1, grads=grads, params=params, updates=updates, opt_state=opt_state)
        metrics = {
            "train/loss": loss,
            "optim/grad_norm": grad_norm,
            "optim/learning_rate": learning_rate_now,
            "optim/grads_finite": finite,
        }
        metrics.update(objective_metrics)
        if load is not None:
            metrics.update(router_load_metrics(load))
        metrics.update(balance_metrics)
        metrics.update(skip_metrics)
        if state.loss_scale.enabled:
            metrics["optim/loss_scale"] = state.loss_scale.scale
        if optimizer.metrics is not None:
            metrics.update(optimizer.metrics(new_opt_state))
        new_state = TrainerState(
            step=state.step + 1,
            model=combine_model(new_params, static, histories, seen),
            opt_state=new_opt_state,
            key=state.key,
            loss_scale=state.loss_scale.adjust(finite),
            kind_state=kind_state,
            averaged=averaged,
            skip_window=skip_window,
            frozen=state.frozen,
        )
        return new_state, metrics

    return train_step
