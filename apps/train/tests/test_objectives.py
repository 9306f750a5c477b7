"""The next-token objective with a mixture of experts: router losses optimised with their weights and logged."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import named_tensors as nt
from lm_models import next_token_loss
from lm_train.config import load_train_config
from lm_train.optim import build_optimizer
from lm_train.run.batch import TokenBatch
from lm_train.run.mesh import plan_mesh
from lm_train.run.objectives import next_token_objective
from lm_train.run.precision import parse_policy
from lm_train.run.state import PURPOSE_DROPOUT, init_state, step_key
from lm_train.run.step import StepSettings, make_train_step

CONFIGS = Path(__file__).parents[3] / "configs"
VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)
TINY_MIXTRAL = ["--model.hidden_dim", "32", "--model.intermediate_dim", "24", "--model.num_layers", "2"]
TINY_MIXTRAL += ["--model.seq_len", "16", "--model.n_routed_experts", "4", "--model.num_experts_per_tok", "2"]
TINY_MIXTRAL += ["--model.lbl_coef", "0.5", "--model.rzl_coef", "0.25"]  # large, so that a dropped term shows
TINY_MIXTRAL += ["--trainer.train_batch_size", "8", "--trainer.num_train_steps", "4", "--optimizer.warmup", "0"]


def _ids(seed: int = 0) -> TokenBatch:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(8, 16), dtype=np.int32)
    return TokenBatch(nt.named(jnp.asarray(ids), ("batch", "position")))


def test_mixtral_step_optimises_and_logs_the_router_losses():
    config, _ = load_train_config([CONFIGS / "mixtral_nano.yaml"], TINY_MIXTRAL)
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = init_state(config, plan, Vocab, optimizer)
    step = make_train_step(optimizer, StepSettings(parse_policy(config.trainer.mp), 1, 0.0), schedule)
    batch = _ids()
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        new_state, metrics = jax.jit(step)(state, batch)

    # The reference: cross-entropy and router losses computed apart, the total weighted by hand.
    params, static = eqx.partition(state.model, eqx.is_inexact_array)
    key = step_key(state.key, state.step, PURPOSE_DROPOUT)

    def total(p):
        model = eqx.combine(p, static)
        _, aux = model.activations_and_aux(batch.input_ids, key=key)
        ce = next_token_loss(model, batch.input_ids, key=key).array
        return ce + 0.5 * aux["router_aux_loss"] + 0.25 * aux["router_z_loss"], (ce, aux)

    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        (loss, (ce, aux)), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params)
    assert sorted(aux) == ["router_aux_loss", "router_z_loss"]
    np.testing.assert_allclose(float(metrics["train/router_aux_loss"]), float(aux["router_aux_loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["train/router_z_loss"]), float(aux["router_z_loss"]), rtol=1e-6)
    # Top-2 of 4: the load-balancing loss is k = 2 when balanced and above it otherwise (Mixtral's form).
    assert 2.0 - 1e-3 <= float(aux["router_aux_loss"]) < 4.0 and float(aux["router_z_loss"]) > 0
    np.testing.assert_allclose(float(metrics["train/loss"]), float(loss), rtol=1e-6)
    assert float(loss) > float(ce) + 1.0  # the weighted router losses are in the optimised loss...
    # ... and in its gradients.
    np.testing.assert_allclose(float(metrics["optim/grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
    assert int(new_state.step) == 1


def test_router_metrics_only_where_the_model_has_them():
    # Traced only (eval_shape): which metrics the objective returns is fixed when the step is traced.
    gpt2, _ = load_train_config([CONFIGS / "gpt2_nano.yaml"], ["--model.hidden_dim", "32", "--model.num_layers", "1"])
    no_z, _ = load_train_config([CONFIGS / "mixtral_nano.yaml"], [*TINY_MIXTRAL, "--model.rzl_coef", "null"])
    batch = _ids(1)
    objective = next_token_objective()
    for config, expected in ((gpt2, []), (no_z, ["router/load", "train/router_aux_loss"])):
        model = jax.eval_shape(lambda c=config: c.model.build(Vocab, key=jax.random.key(0)))
        loss, metrics, _ = jax.eval_shape(objective, model, batch, None)
        assert sorted(metrics) == expected and loss.shape == ()
