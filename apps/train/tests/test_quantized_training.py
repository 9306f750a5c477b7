"""trainer.quantization: fp8 and int8 training of the tiny model, delayed scaling's histories in the state and its
checkpoint (a rerun from the checkpoint is bitwise), and the section's checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_ckpt
import named_tensors as nt
from lm_train.config import load_train_config
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer
from lm_train.run.batch import TokenBatch
from lm_train.run.checkpoints import restore_state
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.quantization import check_quantization
from lm_train.run.state import init_state, state_shapes, trainable
from lm_train.run.step import StepSettings, make_train_step

VOCAB = 64
Vocab = nt.Axis("vocab", VOCAB)
FP8 = "{fp8: true, amax_history_length: 4}"
STEPS = 12


def _ids(seed: int) -> TokenBatch:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(8, 16), dtype=np.int32)
    return TokenBatch(nt.named(jnp.asarray(ids), ("batch", "position")))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _histories(model):
    selected, _ = nt.partition(model, nt.nn.amax_histories)
    return [h for h in jax.tree_util.tree_leaves(selected, is_leaf=nt.is_named) if h is not None]


@pytest.mark.parametrize("section", [FP8, "{int8: true}"], ids=["fp8-delayed", "int8"])
def test_a_quantized_tiny_model_trains(make_config, section, tmp_path):
    config = make_config("--trainer.quantization", section, "--optimizer.learning_rate", "1e-2")
    plain = make_config()
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, STEPS)
    state = init_state(config, plan, Vocab, optimizer)
    plain_state = init_state(plain, plan, Vocab, optimizer)
    # The attention and MLP projections are quantized, the head is not; the weights are the plain model's.
    quantized = [p for p in nt.nn.linear_paths(state.model) if "lm_head" not in p]
    assert quantized and all("blocks" in p for p in quantized)
    assert _leaves(trainable(state.model)) and all(
        np.array_equal(a, b) for a, b in zip(_leaves(trainable(state.model)), _leaves(plain_state.model), strict=True)
    )
    fp8 = "fp8" in section
    histories = _histories(state.model)
    # Delayed fp8 keeps three histories per quantized Linear (input, kernel, gradient), stacked over layers; the
    # optimizer sees none of them (its state has as many leaves as the plain model's).
    assert len(histories) == (3 * len(quantized) if fp8 else 0)
    assert all(h.axis_names == ("layers", "amax_history") for h in histories)
    assert len(jax.tree_util.tree_leaves(state.opt_state)) == len(jax.tree_util.tree_leaves(plain_state.opt_state))

    microbatches = 2 if fp8 else 1  # fp8 also takes the accumulation path: amaxes maxed, gradients averaged
    settings = StepSettings(parse_policy(config.trainer.mp), microbatches, 0.0)
    step = jax.jit(make_train_step(optimizer, settings, schedule))
    batch = _ids(0)
    losses = []
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        for i in range(STEPS):
            state, metrics = step(state, batch)
            losses.append(float(metrics["train/loss"]))
            if fp8 and i == 0:
                first = [np.asarray(h.array) for h in _histories(state.model)]
                assert all(h[:, 0].min() > 0 and not h[:, 1:].any() for h in first)  # one amax seen per layer
            if fp8 and i == 1:  # rolled by one: last step's amax moved to slot 1
                for h, before in zip(_histories(state.model), first, strict=True):
                    np.testing.assert_array_equal(np.asarray(h.array)[:, 1], before[:, 0])
            if i == 2 and fp8:
                saved = state
                dist_ckpt.save(saved, tmp_path / "step-3", step=3, block=True, progress=False)
            if i == 4 and fp8:
                continued = state
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses
    if not fp8:
        return
    # A rerun from the step-3 checkpoint takes the same two steps bit for bit: the histories came back with it.
    restored = restore_state(tmp_path / "step-3", state_shapes(config, plan, Vocab, optimizer))
    for a, b in zip(_leaves(restored), _leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        for _ in range(2):
            restored, _ = step(restored, batch)
    for a, b in zip(_leaves(restored), _leaves(continued), strict=True):
        np.testing.assert_array_equal(a, b)


def test_quantization_keys_resolve_and_bad_ones_name_the_key(make_config, tmp_path):
    path = tmp_path / "levanter.yaml"  # Levanter's key shape, in a file of our own
    path.write_text(
        "data:\n  train_urls: [train.jsonl]\n  tokenizer: tokenizer.json\n"
        "trainer:\n  quantization:\n    fp8: true\n    amax_history_length: 16\n    targets: [q_proj, v_proj]\n",
        encoding="utf-8",
    )
    section = load_train_config([path])[0].trainer.quantization
    assert section.mode == "fp8" and section.delayed and section.target_layers() == ("q_proj", "v_proj")
    assert make_config().trainer.quantization is None
    with pytest.raises(ConfigError, match="sets both fp8 and int8"):
        make_config("--trainer.quantization", "{fp8: true, int8: true}")
    with pytest.raises(ConfigError, match=r"trainer\.quantization\.scaling: unknown scaling 'late'"):
        make_config("--trainer.quantization", "{fp8: true, scaling: late}")
    with pytest.raises(ConfigError, match="amax_history_length must be a positive"):
        make_config("--trainer.quantization", "{fp8: true, amax_history_length: 0}")
    with pytest.raises(ConfigError, match="compute_dtype='bfloat16' is not taken"):
        make_config("--trainer.quantization", "{fp8: true, compute_dtype: bfloat16}")
    config = make_config("--trainer.quantization", "{int8: true, targets: [qkv]}")
    shapes = jax.eval_shape(lambda: config.model.build(Vocab, key=jax.random.key(0)))
    with pytest.raises(ConfigError, match=r"trainer.quantization.targets: quantization targets \['qkv'\] match no"):
        check_quantization(shapes, config.trainer.quantization)
    with pytest.raises(ConfigError, match="with a `lora` section is not built"):
        check_quantization(shapes, config.trainer.quantization, lora=True)
    head = make_config("--trainer.quantization", "{fp8: true, scaling: current, targets: '.*'}")
    check_quantization(shapes, head.trainer.quantization)  # a regex may take the head too
