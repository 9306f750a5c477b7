"""Forgetful causal masking (Levanter's `fcm_prob`): the masked attention against plain jax.numpy, the step
unchanged when it is off, and evaluation and export untouched when it is on."""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import hf_bridge
import named_tensors as nt
from lm_models import next_token_loss
from lm_train.config import load_train_config
from lm_train.optim import build_optimizer
from lm_train.run.batch import TokenBatch
from lm_train.run.mesh import plan_mesh
from lm_train.run.objectives import FCM_PURPOSE, next_token_objective
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state
from lm_train.run.step import StepSettings, make_train_step

CONFIGS = Path(__file__).parents[3] / "configs"
VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)
TINY = ["--model.hidden_dim", "32", "--model.num_heads", "2", "--model.num_layers", "2", "--model.seq_len", "16"]
TINY += ["--trainer.train_batch_size", "4", "--trainer.num_train_steps", "2"]


def _batch(seed: int = 0) -> TokenBatch:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(4, 16), dtype=np.int32)
    return TokenBatch(nt.named(jnp.asarray(ids), ("batch", "position")))


def _reference_attention(q, k, v, keep):
    """Plain jnp: causal attention in which example b's key j (j > 0) is dropped where keep[b, j] is False."""
    t = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    allowed = np.tril(np.ones((t, t), bool))[None, None] & np.asarray(keep)[:, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def test_forgetful_attention_matches_plain_jax_numpy():
    Batch, Pos, Heads, Head = nt.Axis("batch", 6), nt.Axis("position", 32), nt.Axis("heads", 2), nt.Axis("head_size", 8)
    KPos = Pos.alias("key_position")
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(6, 32, 2, 8)), jnp.float32) for _ in range(3))
    keep = nt.nn.forgetful_causal_mask(KPos, 0.4, key=jax.random.key(3), batch_axes=(Batch,))

    assert keep.axes == (Batch, KPos)
    drawn = np.asarray(keep.array)
    assert drawn[:, 0].all()  # the first key is never forgotten
    assert 0.45 < drawn[:, 1:].mean() < 0.75  # about 1 - 0.4 kept
    assert len({row.tobytes() for row in drawn}) == 6  # each example draws its own
    again = nt.nn.forgetful_causal_mask(KPos, 0.4, key=jax.random.key(3), batch_axes=(Batch,))
    assert np.array_equal(np.asarray(again.array), drawn)  # a pure function of the key: resumable

    mask = nt.nn.and_masks(nt.nn.causal_mask(Pos, KPos), keep)
    ours = nt.nn.dot_product_attention(
        Pos,
        KPos,
        Head,
        nt.named(q, (Batch, Pos, Heads, Head)),
        nt.named(k, (Batch, KPos, Heads, Head)),
        nt.named(v, (Batch, KPos, Heads, Head)),
        mask,
    )
    ours = nt.permute(ours, (Batch, Pos, Heads, Head)).array
    np.testing.assert_allclose(ours, _reference_attention(q, k, v, drawn), rtol=1e-5, atol=1e-5)
    plain = _reference_attention(q, k, v, np.ones_like(drawn))
    assert not np.allclose(ours, plain, atol=1e-3)


def _tiny(fcm_prob: float):
    config, _ = load_train_config([CONFIGS / "gpt2_nano.yaml"], [*TINY, "--fcm_prob", str(fcm_prob)])
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    return config, plan


def test_the_objective_masks_in_training_only():
    config, _ = _tiny(0.5)
    model = config.model.build(Vocab, key=jax.random.key(0))
    batch, key = _batch(), jax.random.key(7)
    keep = nt.nn.forgetful_causal_mask(
        nt.Axis("key_position", 16), 0.5, key=jax.random.fold_in(key, FCM_PURPOSE), batch_axes=(nt.Axis("batch", 4),)
    )

    @eqx.filter_jit
    def losses(model):
        objective = next_token_objective(0.0, 0.5)
        return (
            objective(model, batch, key)[0],
            objective(model, batch, None)[0],  # no key: evaluation
            next_token_loss(model, batch.input_ids).array,
            next_token_loss(model, batch.input_ids, key=key).array,
            next_token_loss(model, batch.input_ids, attn_mask=keep, key=key).array,
        )

    forgetful, evaluated, unmasked, plain, by_hand = losses(model)
    assert float(evaluated) == float(unmasked)
    assert abs(float(forgetful) - float(plain)) > 1e-4
    np.testing.assert_allclose(float(forgetful), float(by_hand), rtol=1e-6)


def test_fcm_prob_zero_traces_the_step_of_before():
    config, plan = _tiny(0.0)
    optimizer, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    state = jax.eval_shape(lambda: init_state(config, plan, Vocab, optimizer))  # shapes are enough to trace
    policy = parse_policy("f32")

    def jaxpr(settings: StepSettings, objective=None) -> str:
        step = make_train_step(optimizer, settings, schedule, objective=objective)
        with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
            return str(jax.make_jaxpr(step)(state, _batch()))

    def before(model, batch, key, frozen, kind_state):  # the next-token objective as it was before fcm_prob existed
        loss = next_token_loss(model, batch.input_ids, key=key, **batch.loss_inputs())
        return loss.array.astype(jnp.float32), {}, kind_state

    reference = jaxpr(StepSettings(policy, 1, 0.0), objective=before)
    assert jaxpr(StepSettings(policy, 1, 0.0, fcm_prob=0.0)) == reference
    assert jaxpr(StepSettings(policy, 1, 0.0, fcm_prob=0.15)) != reference


def test_export_is_the_same_with_fcm(tmp_path):
    exported = []
    for prob in (0.0, 0.15):
        config, _ = _tiny(prob)
        model = config.model.build(Vocab, key=jax.random.key(0))
        hf_bridge.save_pretrained(model, config.model, tmp_path / str(prob))
        exported.append({p.name: p.read_bytes() for p in sorted((tmp_path / str(prob)).iterdir())})
    assert exported[0] == exported[1]
    assert b"fcm" not in exported[1]["config.json"]
