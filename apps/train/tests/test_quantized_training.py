"""trainer.quantization: fp8 and int8 training of the tiny model, delayed scaling's histories in the state and its
checkpoint (a rerun from the checkpoint is bitwise), LoRA on a quantized base, and the section's checks."""

from __future__ import annotations

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dist_ckpt
import hf_bridge
import named_tensors as nt
from lm_train.config import load_train_config
from lm_train.errors import ConfigError
from lm_train.optim import build_optimizer
from lm_train.post.lora_training import checkpointed, frozen_base, load_lora_model
from lm_train.run.batch import TokenBatch
from lm_train.run.checkpoints import restore_state
from lm_train.run.mesh import plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.quantization import check_quantization
from lm_train.run.state import init_state, model_shapes, state_shapes, trainable
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


def assert_resumes_bitwise(restored, saved, continued, step, batch, plan) -> None:
    """The state restored from a checkpoint equals the one saved, bit for bit, and two more steps from it equal the
    uninterrupted run's state after them."""
    for a, b in zip(_leaves(restored), _leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        for _ in range(2):
            restored, _ = step(restored, batch)
    for a, b in zip(_leaves(restored), _leaves(continued), strict=True):
        np.testing.assert_array_equal(a, b)


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
    assert_resumes_bitwise(restored, saved, continued, step, batch, plan)


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
    head = make_config("--trainer.quantization", "{fp8: true, scaling: current, targets: '.*'}")
    check_quantization(shapes, head.trainer.quantization)  # a regex may take the head too


def test_lora_on_a_quantized_base_trains_the_adapters_alone_and_resumes_bitwise(make_config, tmp_path):
    """QLoRA-style: the frozen base Linears multiply in fp8 (delayed scaling), the adapters in f32. Only the
    adapters move, the loss falls, the histories roll and are checkpointed with the adapters (the base is not),
    and a rerun from that checkpoint on a fresh base takes the same steps bit for bit."""
    lora = ("--lora", "{r: 4, alpha: 8, target_modules: [c_attn, c_fc]}", "--optimizer.learning_rate", "3e-2")
    config = make_config("--trainer.quantization", FP8, *lora)
    plan = plan_mesh(config.trainer, devices=jax.devices()[:1])
    optimizer, schedule = build_optimizer(config.optimizer, STEPS)
    state = init_state(config, plan, Vocab, optimizer)
    adapted = nt.nn.lora_paths(state.model)
    assert adapted and all("blocks" in p for p in adapted)
    assert len(_histories(state.model)) == 3 * len([p for p in nt.nn.linear_paths(state.model) if "lm_head" not in p])
    # The optimizer sees the adapters alone, in f32; the base layers under them keep their quantized matmul.
    assert len(_leaves(trainable(state.model))) == 2 * len(adapted)
    assert all(x.dtype == jnp.float32 for x in _leaves(trainable(state.model)))
    bases = [layer.base for layer in jax.tree_util.tree_leaves(state.model, is_leaf=_is_lora) if _is_lora(layer)]
    assert len(bases) == len(adapted) and all(base.quant is not None for base in bases)
    frozen = _leaves(eqx.filter(state.model, nt.mask(state.model, ~nt.nn.lora_params & ~nt.nn.amax_histories)))

    step = jax.jit(make_train_step(optimizer, StepSettings(parse_policy(config.trainer.mp), 1, 0.0), schedule))
    batch, losses = _ids(0), []
    with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
        for i in range(STEPS):
            state, metrics = step(state, batch)
            losses.append(float(metrics["train/loss"]))
            if i == 2:
                saved = state
                dist_ckpt.save(checkpointed(saved), tmp_path / "step-3", step=3, block=True, progress=False)
            if i == 4:
                continued = state
    # Rank-4 adapters on a random base learn slowly: every step lowers the loss, by 0.27 in all here.
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < losses[0] - 0.2, losses
    after = _leaves(eqx.filter(state.model, nt.mask(state.model, ~nt.nn.lora_params & ~nt.nn.amax_histories)))
    assert all(np.array_equal(a, b) for a, b in zip(after, frozen, strict=True))  # no gradient reached the base
    lora_b = [np.asarray(layer.lora_b.array) for layer in jax.tree_util.tree_leaves(state.model, is_leaf=_is_lora)
              if _is_lora(layer)]  # fmt: skip
    assert all(b.any() for b in lora_b)  # B starts at zero: every adapter was trained
    # The base's fp8 matmuls ran: each recorded the amaxes it saw, in the forward and the backward.
    assert all(np.asarray(h.array)[:, :2].min() > 0 for h in _histories(state.model))

    # The checkpoint holds the adapters and histories, not the base; restored onto a fresh state, it continues.
    names = [k for k in dist_ckpt.load(tmp_path / "step-3", progress=False) if k.startswith(".model.")]
    assert sum(".grad_history" in k for k in names) == len(_histories(state.model)) // 3
    assert not any(".base.weight" in k for k in names) and sum(".lora_b" in k for k in names) == len(adapted)
    target = state_shapes(config, plan, Vocab, optimizer)
    restored = eqx.combine(
        restore_state(tmp_path / "step-3", checkpointed(target)), init_state(config, plan, Vocab, optimizer)
    )
    assert_resumes_bitwise(restored, saved, continued, step, batch, plan)

    # eval, sample and export load it as they load any LoRA checkpoint: the adapters and histories from it, the
    # base from initialize_from_hf, where a quantized layer loads as a plain one and gets its matmul back.
    base_dir = tmp_path / "base"
    hf_bridge.save_pretrained(nt.nn.plain_linears(frozen_base(saved.model)), config.model, base_dir)
    with_base = make_config("--trainer.quantization", FP8, *lora, "--initialize_from_hf", str(base_dir))
    loaded = load_lora_model(tmp_path / "step-3", with_base, plan, model_shapes(with_base, plan, Vocab), progress=False)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(saved.model)
    for a, b in zip(_leaves(loaded), _leaves(saved.model), strict=True):
        np.testing.assert_array_equal(a, b)


def _is_lora(x) -> bool:
    return isinstance(x, nt.nn.LoraLinear)
