"""The eval step and the Evaluator's mean loss against plain jax.numpy, and the evaluation batch size."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named_tensors as nt
from lm_models import inference_mode
from lm_train.data.batches import ProcessSlice
from lm_train.data.caches import PreparedData
from lm_train.run.evaluation import Evaluator, eval_batch_size, loss_metrics
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy

Vocab = nt.Axis("vocab", 64)


def _reference_loss(model, batches) -> float:
    """Mean next-token cross-entropy written out in jnp, from the model's logits."""
    total, count = 0.0, 0
    model = inference_mode(model)
    for ids in batches:
        logits = model(nt.named(jnp.asarray(ids), ("batch", "position"))).array  # (batch, position, vocab)
        logp = jax.nn.log_softmax(logits[:, :-1, :].astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], axis=-1)
        total += float(-jnp.sum(picked))
        count += picked.size
    return total / count


def test_evaluator_mean_loss_matches_plain_jnp(make_config, monkeypatch):
    config = make_config()
    plan = plan_mesh(config.trainer)
    model = config.model.build(Vocab, key=jax.random.key(0))
    model = jax.device_put(model, nt.infer_sharding(eqx.filter(model, eqx.is_array), plan.param_mapping, plan.mesh))
    batches = [np.random.default_rng(i).integers(0, 64, size=(8, 16), dtype=np.int32) for i in range(3)]
    data = PreparedData("unused", "unused", "validation", [])
    evaluator = Evaluator(config, plan, data, ProcessSlice(), parse_policy(config.trainer.mp))
    monkeypatch.setattr(evaluator, "batches", lambda: iter(batches))
    assert evaluator.has_data
    loss = evaluator.loss(model)
    assert loss == pytest.approx(_reference_loss(model, batches), rel=1e-5)
    monkeypatch.setattr(evaluator, "batches", lambda: iter([]))
    assert evaluator.loss(model) is None
    metrics = loss_metrics(2.0)
    assert metrics["eval/perplexity"] == pytest.approx(np.exp(2.0)) and loss_metrics(1e9)["eval/perplexity"] < np.inf


def test_eval_batch_size_follows_per_device_eval_parallelism(make_config):
    config = make_config()
    plan = plan_mesh(config.trainer)
    assert eval_batch_size(config, plan) == config.trainer.train_batch_size  # -1: as large as training's
    two = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, per_device_eval_parallelism=2))
    assert eval_batch_size(two, plan) == 2 * plan.data_size
