"""The train step against a hand-written step of the same math, microbatching, and the optimizer's hooks."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import named_tensors as nt
from lm_models import next_token_loss
from lm_train.optim import HessianObjective, Optimizer, build_optimizer, chain
from lm_train.run.batch import TokenBatch
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import PURPOSE_DROPOUT, init_state, step_key, trainable
from lm_train.run.step import StepSettings, make_train_step

VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)


def _setup(tiny_config, *overrides: str, microbatches: int = 1, optimizer=None):
    config = tiny_config(*overrides)
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])  # one device: the math, not the sharding, is tested
    built, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    optimizer = optimizer or built
    state = init_state(config, plan, Vocab, optimizer)
    settings = StepSettings(parse_policy(config.trainer.mp), microbatches, config.z_loss_weight)
    step = make_train_step(optimizer, settings, schedule)
    return config, plan, state, step, built


def _ids(seed: int = 0) -> TokenBatch:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(8, 16), dtype=np.int32)
    return TokenBatch(nt.named(jnp.asarray(ids), ("batch", "position")))


def _run(plan, step, state, ids):
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        return jax.jit(step)(state, ids)


def test_one_step_equals_the_same_math_written_by_hand(make_config):
    _config, plan, state, step, optimizer = _setup(
        make_config,
    )
    ids = _ids()
    new_state, metrics = _run(plan, step, state, ids)

    params, static = eqx.partition(state.model, eqx.is_inexact_array)
    key = step_key(state.key, state.step, PURPOSE_DROPOUT)

    def loss_fn(p):
        return next_token_loss(eqx.combine(p, static), ids.input_ids, key=key).array

    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = optimizer.update(grads, state.opt_state, params)
        expected = optax.apply_updates(params, updates)
    np.testing.assert_allclose(float(metrics["train/loss"]), float(loss), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["optim/grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
    assert int(new_state.step) == 1
    for a, b in zip(jax.tree.leaves(trainable(new_state.model)), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_two_microbatches_give_the_loss_and_update_of_the_whole_batch(make_config):
    # Plain SGD, so that the update is the gradient itself (Adam's first step would magnify rounding).
    sgd = chain(optax.sgd(1.0))
    no_dropout = ("--model.embed_pdrop", "0", "--model.resid_pdrop", "0", "--model.attn_pdrop", "0")
    _config, plan, state, whole, _ = _setup(make_config, *no_dropout, optimizer=sgd)
    _, _, state2, micro, _ = _setup(make_config, *no_dropout, microbatches=2, optimizer=sgd)
    ids = _ids(1)
    a, ma = _run(plan, whole, state, ids)
    b, mb = _run(plan, micro, state2, ids)
    np.testing.assert_allclose(float(ma["train/loss"]), float(mb["train/loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(ma["optim/grad_norm"]), float(mb["optim/grad_norm"]), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(trainable(a.model)), jax.tree.leaves(trainable(b.model)), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_a_new_second_order_optimizer_needs_only_its_hooks(make_config):
    """An optimizer the step has never heard of: its hessian_update sees the step's objective, its metrics show."""
    seen = {}

    def hessian_update(opt_state, params, objective: HessianObjective):
        seen["loss"] = objective.loss(params)
        seen["logits_axes"] = objective.logits(params).axis_names
        seen["mask"] = objective.target_mask
        return jax.tree_util.tree_map(lambda x: x + 1, opt_state)  # a visible change of its state

    sgd = optax.sgd(0.1)
    custom = chain(Optimizer(sgd.init, sgd.update, hessian_update, lambda s: {"optim/custom": jnp.float32(7.0)}))
    _config, plan, state, step, _ = _setup(make_config, optimizer=custom)
    ids = _ids(2)

    def run(state, ids):
        new_state, metrics = step(state, ids)
        return new_state, metrics, seen["loss"], seen["mask"].array

    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        _new_state, metrics, objective_loss, mask = jax.jit(run)(state, ids)
    np.testing.assert_allclose(float(objective_loss), float(metrics["train/loss"]), rtol=1e-5)
    assert "vocab" in seen["logits_axes"]
    assert bool(mask[:-1].all()) and not bool(mask[-1])  # the last position has no target
    assert float(metrics["optim/custom"]) == 7.0
    assert "optim/sophia_unclipped_fraction" not in metrics


def test_sophia_reports_through_its_own_hook(make_config):
    _config, plan, state, step, _ = _setup(
        make_config, "--optimizer.type", "sophia-g", "--optimizer.update_hessian_every", "1"
    )
    _new_state, metrics = _run(plan, step, state, _ids(3))
    assert 0.0 <= float(metrics["optim/sophia_unclipped_fraction"]) <= 1.0
    assert np.isfinite(float(metrics["train/loss"]))


def test_masked_and_packed_batches_train_on_exactly_their_tokens(make_config):
    """A loss mask drops predictions; packed documents with restarting positions score as if alone."""
    sgd = chain(optax.sgd(1.0))
    _, plan, state, step, _ = _setup(
        make_config, "--model.embed_pdrop", "0", "--model.resid_pdrop", "0", "--model.attn_pdrop", "0", optimizer=sgd
    )
    ids = _ids(4).input_ids
    half = np.zeros((8, 16), bool)
    half[:, :8] = True
    masked = TokenBatch(ids, loss_mask=nt.named(jnp.asarray(half), ("batch", "position")))
    _, metrics = _run(plan, step, state, masked)
    params, static = eqx.partition(state.model, eqx.is_inexact_array)
    key = step_key(state.key, state.step, PURPOSE_DROPOUT)
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        reference = jax.jit(
            lambda p: next_token_loss(eqx.combine(p, static), ids, key=key, loss_mask=masked.loss_mask).array
        )(params)
    np.testing.assert_allclose(float(metrics["train/loss"]), float(reference), rtol=1e-6)

    # Two documents of 8 tokens packed in each row: segment ids and positions restarting at 0.
    segments = np.repeat([[0] * 8 + [1] * 8], 8, axis=0).astype(np.int32)
    positions = np.tile(np.concatenate([np.arange(8), np.arange(8)]), (8, 1)).astype(np.int32)
    packed = TokenBatch(
        ids,
        segment_ids=nt.named(jnp.asarray(segments), ("batch", "position")),
        positions=nt.named(jnp.asarray(positions), ("batch", "position")),
        loss_mask=nt.named(jnp.asarray(positions < 7), ("batch", "position")),  # no prediction across documents
    )
    _, packed_metrics = _run(plan, step, state, packed)
    halves = nt.named(jnp.concatenate([ids.array[:, :8], ids.array[:, 8:]]), ("batch", "position"))
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        alone = jax.jit(lambda p: next_token_loss(eqx.combine(p, static), halves, key=None).array)(params)
    # Without dropout the key does not matter: the packed loss is the mean over both documents, scored alone.
    np.testing.assert_allclose(float(packed_metrics["train/loss"]), float(alone), rtol=1e-5)


def test_an_objective_of_its_own_is_differentiated_and_its_metrics_logged(make_config):
    """The step trains whatever objective it is given: here half the LM loss, with a metric of its own."""
    from lm_train.run.objectives import next_token_objective
    from lm_train.run.precision import parse_policy

    config = make_config()
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, 4)
    state = init_state(config, plan, Vocab, optimizer)
    lm = next_token_objective()

    def half(model, batch, key, frozen, kind_state):
        loss, _, _ = lm(model, batch, key, frozen, kind_state)
        return 0.5 * loss, {"train/full_loss": loss}, kind_state

    settings = StepSettings(parse_policy(config.trainer.mp), 2, 0.0)  # two microbatches: metrics are averaged
    _, metrics = _run(plan, make_train_step(optimizer, settings, schedule, objective=half), state, _ids(5))
    np.testing.assert_allclose(float(metrics["train/loss"]), 0.5 * float(metrics["train/full_loss"]), rtol=1e-6)


def test_without_loss_scaling_the_finite_flag_comes_from_the_norm_in_one_pass(make_config):
    """grads_finite still catches a NaN gradient, but the step reads the gradients once for it, not once more."""
    _config, plan, state, step, _ = _setup(make_config)
    assert not state.loss_scale.enabled
    ids = _ids()
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        program = jax.jit(step).lower(state, ids).as_text()
    # Only the scalar norm and the loss's own (batch, position) values are checked; the exact check, one pass
    # per gradient leaf, is for loss scaling alone.
    checked = re.findall(r"stablehlo.is_finite %\w+ : \(tensor<([^>]*)>\)", program)
    assert "f32" in checked and set(checked) <= {"f32", "8x16xf32"}, checked
    _, metrics = _run(plan, step, state, ids)
    assert bool(metrics["optim/grads_finite"]) and np.isfinite(float(metrics["optim/grad_norm"]))

    params, static = eqx.partition(state.model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    leaves[-1] = leaves[-1].at[(0,) * leaves[-1].ndim].set(jnp.nan)
    poisoned = eqx.tree_at(lambda s: s.model, state, eqx.combine(jax.tree.unflatten(treedef, leaves), static))
    _, metrics = _run(plan, step, poisoned, ids)
    assert not bool(metrics["optim/grads_finite"])
