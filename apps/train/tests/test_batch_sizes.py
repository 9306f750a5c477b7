"""Batch-size schedules and padded batches: the config's checks, the rows each step reads (against index math
written here), microbatches per size, the planned size, and a padded step against the same examples unpadded."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import named_tensors as nt
import shard_cache
from lm_train.config.batch_sizes import planned_batch
from lm_train.config.mixture_keys import SINGLE_SOURCE
from lm_train.data.batches import ProcessSlice, TrainBatches
from lm_train.errors import ConfigError
from lm_train.kinds import training_kind
from lm_train.optim import build_optimizer, chain
from lm_train.run.compiled import CompiledStep, StateLayout
from lm_train.run.mesh import check_batch_fits, plan_mesh
from lm_train.run.precision import parse_policy
from lm_train.run.state import init_state, state_shapes, trainable
from lm_train.run.step import StepSettings, make_train_step

SCHEDULE = "[{start: 0, value: 4}, {start: 3, value: 8}, {start: 5, value: 6}]"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[{start: 1, value: 4}]", r"train_batch_size\[0\]\.start is 1: the first stage .* starts at step 0"),
        ("[{start: 0, value: 4}, {start: 0, value: 8}]", r"\[1\]\.start is 0, not after .*\[0\]\.start \(0\)"),
        ("[{start: 0, value: 4}, {start: 9, value: 8}, {start: 5, value: 2}]", "starts must rise strictly"),
        ("[{start: 0, value: 0}]", r"train_batch_size\[0\]\.value must be at least 1"),
        ("[{start: 0, value: 4.5}]", r"train_batch_size\[0\]\.value is 4\.5: write a whole number"),
        ("[{start: 0}]", r"train_batch_size\[0\] is \{'start': 0\}: each stage is \{start: STEP, value: SIZE\}"),
        ("[{start: 0, size: 4}]", r"unknown key `trainer\.train_batch_size\.0\.size`"),
        ("lots", "train_batch_size is 'lots': write a number of examples per step, or a list"),
        ("0", "train_batch_size must be at least 1"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_key_and_the_fix(make_config, value, message):
    with pytest.raises(ConfigError, match=message):
        make_config("--trainer.train_batch_size", value)


def test_sizes_divide_over_the_devices_unless_padding_is_allowed_and_each_size_has_its_microbatches(make_config):
    plan = plan_mesh(make_config().trainer)  # 8 data-parallel devices
    trainer = make_config("--trainer.train_batch_size", "[{start: 0, value: 8}, {start: 3, value: 12}]").trainer
    with pytest.raises(ConfigError, match=r"\[1\]\.value=12 \(from step 3\) does not divide over the 8 data-para"):
        check_batch_fits(trainer, plan, 1)
    padded = dataclasses.replace(trainer, allow_nondivisible_batch_size=True)
    assert check_batch_fits(padded, plan, 1) == 1
    with pytest.raises(ConfigError, match=r"a padded batch .* is not split into microbatches"):
        check_batch_fits(dataclasses.replace(padded, per_device_parallelism=1), plan, 1)

    config = make_config(
        "--trainer.train_batch_size", "[{start: 0, value: 8}, {start: 3, value: 32}, {start: 5, value: 16}]",
        "--trainer.per_device_parallelism", "1",
    )  # fmt: skip
    microbatches = check_batch_fits(config.trainer, plan, 1)
    settings = StepSettings.of_config(config, microbatches)
    assert microbatches == 4 and settings.microbatch_rows == 8
    assert [settings.microbatches_of(n) for n in (8, 32, 16)] == [1, 4, 2]
    fixed = make_config("--trainer.train_batch_size", "32", "--trainer.per_device_parallelism", "1")
    assert StepSettings.of_config(fixed, 4).microbatch_rows is None  # a fixed size: the same program as ever
    with pytest.raises(ConfigError, match=r"per_device_parallelism=3 .* do not divide .*\[0\]\.value=8"):
        check_batch_fits(dataclasses.replace(config.trainer, per_device_parallelism=3), plan, 1)


def test_the_plan_and_other_kinds_see_one_size(make_config):
    config = make_config("--trainer.train_batch_size", SCHEDULE)
    assert planned_batch(config, 8).trainer.train_batch_size == 8
    padded = make_config("--trainer.train_batch_size", SCHEDULE, "--trainer.allow_nondivisible_batch_size", "true")
    assert planned_batch(padded, 4, 1).trainer.train_batch_size == 8
    fixed = make_config("--trainer.train_batch_size", "6")
    assert planned_batch(fixed, 2) is fixed  # a fixed size that divides: the config as it is
    dpo = training_kind("dpo")
    with pytest.raises(ConfigError, match="lm-train dpo trains on one batch size"):
        dpo.check_batch_sizes(config, 8)
    with pytest.raises(ConfigError, match="lm-train dpo does not pad its batches"):
        dpo.check_batch_sizes(make_config("--trainer.train_batch_size", "6", *padded_flag()), 8)
    training_kind("run").check_batch_sizes(padded, 8)


def padded_flag() -> tuple[str, str]:
    return ("--trainer.allow_nondivisible_batch_size", "true")


class MemoryReader:
    """A finished cache in memory, for TokenWindows: token window i holds the value i + 1 (0 is padding's)."""

    def __init__(self, num_examples: int, seq_len: int):
        self.stream = np.repeat(np.arange(1, num_examples + 1, dtype=np.int32), seq_len)
        self.num_tokens, self.finished, self.url = len(self.stream), True, "memory://0"

    def wait_until(self, condition, timeout, what):
        if not condition():
            raise IndexError(f"{what}: the finished cache does not have it")

    def tokens(self, start: int, stop: int) -> np.ndarray:
        return self.stream[start:stop]

    def committed_state(self) -> tuple[int, bool]:
        return self.num_tokens, self.finished


def reader_batches(config, part: ProcessSlice, pad_to: int = 1) -> TrainBatches:
    windows = {SINGLE_SOURCE: shard_cache.TokenWindows(MemoryReader(1000, 4), 4)}
    return TrainBatches(windows, config.data, config.trainer.batch_schedule, 0, part, pad_to=pad_to)


def test_each_step_reads_the_examples_after_the_earlier_steps_and_pads_its_last_rows(make_config):
    config = make_config("--trainer.train_batch_size", SCHEDULE, "--data.shuffle", "false")
    sizes = [4, 4, 4, 8, 8, 6, 6, 6]  # steps 0-7 of SCHEDULE, by hand
    starts = np.cumsum([0, *sizes])
    for count in (1, 2):
        readers = [reader_batches(config, ProcessSlice(i, count)) for i in range(count)]
        resumed = reader_batches(config, ProcessSlice(0, count))  # a new reader asked for a later step first
        assert resumed.batch(6)[0, 0] - 1 == starts[6]
        for step, size in enumerate(sizes):
            rows = np.concatenate([r.batch(step) for r in readers])
            # shuffle false: position p of the run is window p, which holds p + 1
            np.testing.assert_array_equal(rows[:, 0] - 1, np.arange(starts[step], starts[step] + size))
            assert not readers[0].pads and readers[0].rows(step) == size
    # 6 does not divide over 4 devices: padded to 8, each of 2 processes reads 4 rows, the second 2 real and 2 zero
    parts = [reader_batches(config, ProcessSlice(i, 2), pad_to=4) for i in range(2)]
    assert parts[0].pads and parts[0].rows(5) == 8 and parts[0].rows(3) == 8 and parts[0].rows(0) == 4
    for step in range(8):
        got = [p.batch(step) for p in parts]
        ids = np.concatenate([g["input_ids"] for g in got])
        mask = np.concatenate([g["loss_mask"] for g in got])
        real = sizes[step]
        np.testing.assert_array_equal(ids[:real, 0] - 1, np.arange(starts[step], starts[step] + real))
        assert (ids[real:] == 0).all() and mask[:real].all() and not mask[real:].any()


def test_a_padded_step_trains_as_the_same_examples_unpadded(make_config):
    """6 examples padded to 8 rows over 4 devices give the loss, gradient norm and update of the 6 alone on one
    device (plain SGD: the update is the gradient)."""
    no_dropout = ("--model.embed_pdrop", "0", "--model.resid_pdrop", "0", "--model.attn_pdrop", "0")
    config = make_config("--trainer.train_batch_size", "6", *padded_flag(), *no_dropout)
    sgd = chain(optax.sgd(1.0))
    _, schedule = build_optimizer(config.optimizer, config.trainer.num_train_steps)
    Vocab = nt.Axis("vocab", 64)
    rows = np.random.default_rng(3).integers(1, 64, size=(6, config.model.Pos.size), dtype=np.int32)

    def one_step(devices, batch):
        plan = plan_mesh(config.trainer, devices=devices)
        settings = StepSettings(parse_policy(config.trainer.mp), 1, 0.0, config.trainer.batch_axis)
        step = CompiledStep(
            make_train_step(sgd, settings, schedule),
            StateLayout(state_shapes(config, plan, Vocab, sgd)),
            plan,
            config.model.Pos,
            config.trainer.batch_axis,
        )
        state = init_state(config, plan, Vocab, sgd)
        return step(state, batch)

    padded = {"input_ids": np.zeros((8, rows.shape[1]), np.int32), "loss_mask": np.zeros((8, rows.shape[1]), bool)}
    padded["input_ids"][:6], padded["loss_mask"][:6] = rows, True
    state, metrics = one_step(jax.devices()[:4], padded)
    ref_state, ref_metrics = one_step(jax.devices()[:1], rows)
    for key in ("train/loss", "optim/grad_norm"):
        np.testing.assert_allclose(float(metrics[key]), float(ref_metrics[key]), rtol=2e-6)
    leaves = jax.tree.leaves(eqx.filter(trainable(state.model), eqx.is_array))
    ref_leaves = jax.tree.leaves(eqx.filter(trainable(ref_state.model), eqx.is_array))
    for a, b in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
