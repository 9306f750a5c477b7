"""`lm-train plan`'s peak estimate (traced, never compiled) against XLA's own memory analysis of the compiled step.

The reference is `compiled.memory_analysis()` of the very step `lm-train run` compiles (CompiledStep, on 1 or 8
of the session's CPU devices): arguments + outputs not aliased to them + XLA's temporaries. The shapes are
small but keep a real run's proportions (vocabulary > hidden width, a few sequences per device), so no single
odd buffer decides the ratio.
"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from lm_train.config import load_train_config
from lm_train.planning.devices import parse_devices
from lm_train.planning.estimate import Planner
from lm_train.planning.xla_check import xla_memory

CONFIGS = Path(__file__).parents[3] / "configs"
VOCAB = 1024
SHAPE = ["--model.hidden_dim", "128", "--model.num_heads", "4", "--model.num_layers", "2", "--model.seq_len", "128"]
SHAPE += ["--trainer.train_batch_size", "8"]
LLAMA = ["--model.intermediate_dim", "352"]
NO_REMAT, REMAT = ["--model.gradient_checkpointing", "false"], ["--model.gradient_checkpointing", "true"]
UNROLLED = ["--model.scan_layers", "false"]
ROLLED = ["--model.scan_unroll", "1"]  # without remat, `auto` would unroll the scan on CPU
BF16 = ["--trainer.mp", "p=f32,c=bfloat16"]
FSDP_TP = ["--trainer.model_axis_size", "2"]  # 8 devices: data 4 (FSDP over embed) x model 2 (heads, mlp)
PIPELINE = ["--trainer.pipeline_axis_size", "2"]  # with FSDP_TP: stage 2 x data 2 x model 2, 4 microbatches
CONTEXT = ["--trainer.context_axis_size", "4"]  # 8 devices: data 2 x context 4, ring attention over 32 positions
EXPERT = ["--trainer.expert_axis_size", "4"]  # 8 devices: data 2 x expert 4, one of Mixtral's 4 experts each
# Llama 4 and DeepSeek-V3 nanos keep their own widths (head and latent sizes), with one dense and one MoE layer.
OWN_WIDTH = {"llama4": ["--model.num_layers", "2", "--model.seq_len", "64", "--trainer.train_batch_size", "4"]}
OWN_WIDTH["deepseek_v3"] = OWN_WIDTH["llama4"]

# (family, devices, overrides): eight configs that cover each axis both ways (GPT-2/Llama, remat or not, scanned
# or unrolled, 1 or 8 devices with FSDP+TP, f32 or bf16 compute); each costs one compile of the step. The ninth
# checkpoints unrolled layers, which XLA:CPU does not honour: the plan must count what XLA keeps, not the policy.
# The tenth and eleventh are the nano configs' own layout on CPU: no remat, `scan_unroll: auto`, so a scan unrolled
# in full. The twelfth is pipeline parallelism: one device's stage of layers and every microbatch in flight. The
# thirteenth is context parallelism: each device's ring attention, its key/value blocks passed round. Then the
# MoE families: Mixtral (top-2 of 4 experts) on one device and with its experts split (the all-to-all's buffers),
# Llama 4 (a shared expert) and DeepSeek-V3 (latent attention, grouped routing, a shared expert, one multi-token
# prediction depth).
CASES = {
    "gpt2-1dev-scan-remat-f32": ("gpt2", 1, REMAT),
    "gpt2-1dev-unrolled-f32": ("gpt2", 1, NO_REMAT + UNROLLED),
    "gpt2-8dev-fsdp-tp-scan-f32": ("gpt2", 8, NO_REMAT + ROLLED + FSDP_TP),
    "gpt2-8dev-fsdp-tp-unrolled-bf16": ("gpt2", 8, NO_REMAT + UNROLLED + FSDP_TP + BF16),
    "llama-1dev-unrolled-bf16": ("llama", 1, NO_REMAT + UNROLLED + BF16),
    "llama-1dev-scan-remat-bf16": ("llama", 1, REMAT + BF16),
    "llama-8dev-fsdp-tp-scan-remat-bf16": ("llama", 8, REMAT + FSDP_TP + BF16),
    "llama-8dev-fsdp-tp-unrolled-bf16": ("llama", 8, NO_REMAT + UNROLLED + FSDP_TP + BF16),
    "llama-1dev-unrolled-remat-f32": ("llama", 1, REMAT + UNROLLED),
    "gpt2-1dev-auto-f32": ("gpt2", 1, NO_REMAT),
    "llama-1dev-auto-f32": ("llama", 1, NO_REMAT),
    "llama-8dev-pipeline-fsdp-tp-scan-f32": ("llama", 8, NO_REMAT + ROLLED + FSDP_TP + PIPELINE),
    "llama-8dev-context4-scan-f32": ("llama", 8, NO_REMAT + ROLLED + CONTEXT),
    "mixtral-1dev-auto-f32": ("mixtral", 1, []),
    "mixtral-8dev-expert4-auto-f32": ("mixtral", 8, EXPERT),
    "llama4-1dev-unrolled-f32": ("llama4", 1, []),
    "deepseek_v3-1dev-auto-f32": ("deepseek_v3", 1, []),
}


# Under jax 0.11, XLA:CPU honours remat of unrolled layers only in part, which the plan does not model yet
# (docs/scaling.md): it reads 0.849 for this case. Strict, so that a fix shows.
JAX_0_11 = tuple(int(part) for part in jax.__version__.split(".")[:2]) >= (0, 11)
KNOWN_GAP = pytest.mark.xfail(strict=True, reason="jax 0.11: unrolled layers with remat on CPU read 0.85")


def _marks(name: str) -> list:
    return [KNOWN_GAP] if JAX_0_11 and name == "llama-1dev-unrolled-remat-f32" else []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CASES])
def test_the_peak_estimate_is_within_15_percent_of_xlas(name):
    family, devices, overrides = CASES[name]
    extra = LLAMA if family == "llama" else []
    shape = OWN_WIDTH.get(family, SHAPE)
    config, _ = load_train_config([CONFIGS / f"{family}_nano.yaml"], [*shape, *extra, *overrides])
    assert len(jax.devices()) >= devices

    estimate = Planner(config, parse_devices(f"cpu:{devices}"), VOCAB).estimate(config)
    xla = xla_memory(config, VOCAB, jax.devices()[:devices])

    # The state's shards are exact (the same shapes and shardings as the compiled step's arguments).
    assert estimate.argument_bytes == xla["argument_bytes"]
    ratio = estimate.peak_bytes / xla["peak_bytes"]
    print(f"{name}: estimate {estimate.peak_bytes} XLA {xla['peak_bytes']} ratio {ratio:.3f}")
    assert 0.85 <= ratio <= 1.15, (name, estimate, xla)


# Levanter 1.1's nano configs as its wheel ships them (their model and trainer sections; data aside), at their own
# shapes and vocabularies, on one device. llama2_nano is the run of issue 40 (seq_len 2048, batch 32, Llama's
# default intermediate_dim 11008 at width 32): 24.2 GiB in XLA's figure, read 0.97 here. gpt2_nano and backpack_nano
# accumulate 32 microbatches of 1 sequence; in the loss's backward inside that loop the plan counts three
# logits-sized buffers (exp(logits - max), the gather's scatter-add gradient, and their sum) where XLA's figure
# holds about two, and they read 1.43 and 1.35. Letting an elementwise fusion write over a dying operand closes
# that gap but takes llama2_nano, whose loss is not in a loop, to 0.72 (XLA's figure there fits three). Strict, so
# that a fix shows.
OVER_IN_MICROBATCH_LOOP = pytest.mark.xfail(strict=True, reason="the loss's backward inside the microbatch loop")
LEVANTER_NANO = {
    "llama2_nano": (
        "type: llama\nhidden_dim: 32\nnum_heads: 4\nnum_layers: 2",
        "mp: p=f32\ntrain_batch_size: 32",
        32000,
    ),
    "gpt2_nano": (
        "type: gpt2\nhidden_dim: 32\nnum_heads: 4\nnum_layers: 2",
        "mp: f32\nper_device_parallelism: 1\ntrain_batch_size: 32",
        50257,
    ),
    "backpack_nano": (
        "type: backpack\nhidden_dim: 32\nnum_heads: 4\nnum_layers: 2\nseq_len: 512\ngradient_checkpointing: true\n"
        "scale_attn_by_inverse_layer_idx: true\nnum_senses: 16\nsense_intermediate_scale: 4",
        "mp: f32\ntrain_batch_size: 32\nper_device_parallelism: 1\nmodel_axis_size: 1",
        50257,
    ),
}


def _section(name: str, body: str) -> str:
    return f"{name}:\n" + "".join(f"  {line}\n" for line in body.splitlines())


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[OVER_IN_MICROBATCH_LOOP] if n != "llama2_nano" else []) for n in LEVANTER_NANO]
)
def test_levanter_nano_shapes_are_within_15_percent_of_xlas(name, tmp_path):
    model, trainer, vocab = LEVANTER_NANO[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(_section("model", model) + _section("trainer", trainer))
    config, _ = load_train_config([path])

    estimate = Planner(config, parse_devices("cpu:1"), vocab).estimate(config)
    xla = xla_memory(config, vocab, jax.devices()[:1])

    assert estimate.argument_bytes == xla["argument_bytes"]
    ratio = estimate.peak_bytes / xla["peak_bytes"]
    print(f"{name}: estimate {estimate.peak_bytes} XLA {xla['peak_bytes']} ratio {ratio:.3f}")
    assert 0.85 <= ratio <= 1.15, (name, estimate, xla)


class _GroupedInputs:
    """jax 0.11's `ft_in` as far as plan reads it: the scan's inputs in three groups."""

    def __init__(self, *groups):
        self.groups = groups

    def unpack(self):
        return self.groups


def test_a_scans_constants_and_carries_are_read_from_either_jax_lines_parameters():
    from lm_train.planning.program import _scan_counts

    assert _scan_counts({"num_consts": 2, "num_carry": 1, "length": 4}, 5) == (2, 1)  # jax 0.10
    assert _scan_counts({"ft_in": _GroupedInputs([None], [None, None], [None, None])}, 5) == (1, 2)  # jax 0.11
    with pytest.raises(ValueError, match="does not list its 4 inputs"):
        _scan_counts({"ft_in": _GroupedInputs([None], [None, None], [None, None])}, 4)


def test_an_expert_parallel_plan_holds_each_devices_experts():
    # Traced only: Mixtral nano at expert 4 x data 2 plans (its routing over every expert, its experts split) and
    # counts exactly the state's shards the compiled step takes (XLA's argument bytes read 2979612 for this too).
    import math

    import named_tensors as nt
    from lm_train.optim import build_optimizer
    from lm_train.run.mesh import plan_mesh
    from lm_train.run.state import state_shapes

    config, _ = load_train_config([CONFIGS / "mixtral_nano.yaml"], [*SHAPE, "--trainer.expert_axis_size", "4"])
    estimate = Planner(config, parse_devices("cpu:8"), VOCAB).estimate(config)
    plan = plan_mesh(config.trainer)
    optimizer, _ = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    shapes = state_shapes(config, plan, nt.Axis("vocab", VOCAB), optimizer)
    leaves = jax.tree.leaves(shapes.model, is_leaf=nt.is_named)
    experts = [x.array for x in leaves if nt.is_named(x) and "experts" in x.axis_names and x.array.ndim == 4]
    assert len(experts) == 3  # gate, up, down: (layers, experts, mlp, embed), 1 of 4 experts and 1/2 of embed each
    for x in experts:
        assert math.prod(x.sharding.shard_shape(x.shape)) * 8 == math.prod(x.shape)
    held = sum(
        math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
        for s in jax.tree.leaves(shapes)
        if isinstance(s, jax.ShapeDtypeStruct)
    )
    tokens = config.trainer.train_batch_size // 8 * config.model.Pos.size * 4  # each device's int32 ids
    assert estimate.argument_bytes == held + tokens
