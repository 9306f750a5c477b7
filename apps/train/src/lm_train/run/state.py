"""The trainer state: one pytree of step, model, optimizer state, key and loss scale; its shapes and its init."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from lm_train.config.schema import TrainLmConfig
from lm_train.optim.skip_steps import init_window
from lm_train.post.lora_training import add_adapters, trainable_spec
from lm_train.run.compiled import StateLayout
from lm_train.run.mesh import MeshPlan
from lm_train.run.model_averaging import initial_average
from lm_train.run.precision import LossScale, needs_loss_scaling, parse_policy
from lm_train.run.quantization import quantize_model

# Purposes of random draws: the key of a draw is fold_in(fold_in(run key, step), purpose); initialisation uses
# fold_in(run key, PURPOSE_INIT) (and LoRA adapters fold_in(run key, lora_training.PURPOSE_LORA_INIT)).
PURPOSE_INIT = 0
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
    kind_state: Any = None
    """What a kind of training carries from step to step and checkpoints (a mixture's domain weights); None for
    language modelling, whose state and checkpoints then hold exactly what they always have."""
    averaged: Any = None
    """An average of the trainable weights over the steps (trainer.model_averaging), checkpointed; None without
    model averaging, whose state and checkpoints then hold exactly what they always have."""
    skip_window: Any = None
    """The recent gradient norms that optimizer.skip_bad_steps judges a step by (lm_train.optim.skip_steps),
    checkpointed, so a resumed run skips the same steps; None when off."""
    frozen: Any = None
    """A frozen model that a kind's objective compares against, in the compute dtype; None otherwise. It
    is not checkpointed: the kind rebuilds it the same way on a fresh start and on resume."""

    def checkpointed(self) -> TrainerState:
        """What a checkpoint holds: the state without its frozen model."""
        return self if self.frozen is None else dataclasses.replace(self, frozen=None)


def step_key(base_key: jax.Array, step: jax.Array, purpose: int) -> jax.Array:
    """The key of one draw, a pure function of (run key, step, purpose)."""
    key = jax.random.wrap_key_data(base_key)
    return jax.random.fold_in(jax.random.fold_in(key, step), purpose)


def trainable(model: Any) -> Any:
    """What the optimizer updates: the floating-point arrays of a model (its adapters alone, with LoRA)."""
    return eqx.filter(model, trainable_spec(model))


def _model_factory(config: TrainLmConfig, Vocab: nt.Axis):
    policy = parse_policy(config.trainer.mp)

    def make() -> Any:
        # The key is made inside: under eval_shape nothing then runs (no compile just to know the shapes).
        model_key = jax.random.fold_in(jax.random.key(config.trainer.seed), PURPOSE_INIT)
        model = quantize_model(
            policy.cast_to_param(config.model.build(Vocab, key=model_key)), config.trainer.quantization
        )
        return add_adapters(model, config)

    return make


def _state_factory(config: TrainLmConfig, Vocab: nt.Axis, optimizer: Any):
    policy = parse_policy(config.trainer.mp)
    make_model = _model_factory(config, Vocab)
    skip = getattr(config.optimizer, "skip_steps", None)

    def make() -> TrainerState:
        model = make_model()
        with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32 counts
            opt_state = optimizer.init(trainable(model))
        return TrainerState(
            step=jnp.zeros((), jnp.int32),
            model=model,
            opt_state=opt_state,
            key=jax.random.key_data(jax.random.key(config.trainer.seed)),
            loss_scale=LossScale.create(needs_loss_scaling(policy)),
            averaged=initial_average(model) if config.trainer.model_averaging is not None else None,
            skip_window=init_window(skip) if skip is not None else None,
        )

    return make


def _with_shardings(shapes: Any, plan: MeshPlan) -> Any:
    shardings = nt.infer_sharding(shapes, plan.param_mapping, plan.mesh)

    def place(sharding: Any, s: Any) -> Any:
        # None: a leaf filtered out of the tree (a LoRA run's optimizer state has none for the frozen base).
        return s if sharding is None else jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    return jax.tree_util.tree_map(place, shardings, shapes, is_leaf=lambda x: x is None)


def shapes_of(tree: Any) -> Any:
    """A tree's arrays as ShapeDtypeStructs with their shardings (a target to restore or compile for)."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if eqx.is_array(x) else x, tree
    )


def state_structure(config: TrainLmConfig, Vocab: nt.Axis, optimizer: Any) -> TrainerState:
    """The state's global shapes and dtypes (ShapeDtypeStructs, no shardings): traced, nothing allocated."""
    return eqx.filter_eval_shape(_state_factory(config, Vocab, optimizer))


def state_shapes(config: TrainLmConfig, plan: MeshPlan, Vocab: nt.Axis, optimizer: Any) -> TrainerState:
    """The state's structure as ShapeDtypeStructs carrying their shardings: a target to load onto."""
    return _with_shardings(state_structure(config, Vocab, optimizer), plan)


def model_shapes(config: TrainLmConfig, plan: MeshPlan, Vocab: nt.Axis) -> Any:
    """The model's structure alone (no optimizer), with shardings: what sample, eval and export load."""
    return _with_shardings(eqx.filter_eval_shape(_model_factory(config, Vocab)), plan)


def init_model(config: TrainLmConfig, plan: MeshPlan, Vocab: nt.Axis) -> Any:
    """The seed's initial model alone (no optimizer state), created directly in its sharded layout."""
    layout = StateLayout(model_shapes(config, plan, Vocab))
    make = _model_factory(config, Vocab)
    return layout.state(jax.jit(lambda: layout.arrays(make()), out_shardings=layout.shardings)())


def init_state(config: TrainLmConfig, plan: MeshPlan, Vocab: nt.Axis, optimizer: Any) -> TrainerState:
    """A fresh state, created directly in its sharded layout (no full copy on one device)."""
    layout = StateLayout(state_shapes(config, plan, Vocab, optimizer))
    make = _state_factory(config, Vocab, optimizer)
    arrays = jax.jit(lambda: layout.arrays(make()), out_shardings=layout.shardings)()
    return layout.state(arrays)
