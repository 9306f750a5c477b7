"""A run that does not fit in memory is refused before it compiles, after it compiles (XLA's figure), or, when an
allocation still fails, with one paragraph: each exit status 2, no traceback. The limit comes from the host's
RAM, a cgroup, or LM_TRAIN_MEMORY_LIMIT; on CPU, a loss whose logits would not fit is scored in blocks."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

from lm_train.cli import app
from lm_train.errors import UserError
from lm_train.language_modeling import LANGUAGE_MODELING
from lm_train.planning.devices import DeviceSpec
from lm_train.planning.estimate import Planner
from lm_train.planning.loss_blocks import with_loss_blocks
from lm_train.planning.memory_limit import (
    MemoryLimit,
    cgroup_free_bytes,
    device_memory_limit,
    mem_available_bytes,
    parse_size,
)
from lm_train.planning.plan import make_plan
from lm_train.run.distributed import DistributedInfo
from lm_train.run.memory_guard import MemoryGuard, OutOfMemoryError, check_before_compile, with_run_loss_blocks
from lm_train.run.preflight import prepare_run

from .conftest import CONFIG, TINY

ONE = DistributedInfo(0, 1, "test")
GiB, MiB = 2**30, 2**20
VOCAB = 384  # what the run plans for: data.vocab_size, the BPE a first run would train (at least 260)
OOM = "RESOURCE_EXHAUSTED: Out of memory allocating 25961968896 bytes."


@pytest.fixture(autouse=True)
def _own_cache_and_no_overrides(tmp_path, monkeypatch):
    """Estimates kept in this test's folder; no limit or skip from the environment that runs the tests."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("LM_TRAIN_MEMORY_LIMIT", raising=False)
    monkeypatch.delenv("LM_TRAIN_SKIP_MEMORY_CHECK", raising=False)


@pytest.mark.parametrize(
    ("text", "size"),
    [("123456", 123456), ("512MiB", 512 * MiB), ("20G", 20 * GiB), ("1.5GiB", int(1.5 * GiB)), ("64 kb", 65536)],
)
def test_memory_sizes_read_in_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1", "0", "12 parsecs"])
def test_a_bad_memory_size_names_the_variable_and_the_form(text):
    with pytest.raises(UserError, match=r"LM_TRAIN_MEMORY_LIMIT=.*20GiB"):
        parse_size(text)


def test_available_ram_and_a_cgroups_limit_are_read_from_the_kernels_files(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683772 kB\nMemFree:        19982948 kB\nMemAvailable:   22055884 kB\n")
    assert mem_available_bytes(meminfo) == 22055884 * 1024
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{GiB}\n")
    (v2 / "memory.current").write_text(f"{600 * MiB}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {100 * MiB}\nactive_file 5\n")
    assert cgroup_free_bytes(v2) == GiB - 500 * MiB  # page cache it can drop does not count as used
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_free_bytes(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    assert cgroup_free_bytes(tmp_path / "v1") == GiB


def test_the_limit_is_the_override_or_the_hosts_ram_shared_by_its_cpu_devices(monkeypatch):
    devices = jax.devices()
    limit = device_memory_limit(devices)
    assert f"shared by {len(devices)} CPU devices" in limit.why
    assert 0 < limit.per_device * len(devices) <= mem_available_bytes()
    monkeypatch.setenv("LM_TRAIN_MEMORY_LIMIT", "3MiB")
    assert device_memory_limit(devices) == MemoryLimit(3 * MiB, "LM_TRAIN_MEMORY_LIMIT")


def _setup(tmp_path, *overrides):
    from lm_train.config import load_train_config

    args = [*TINY, "--data.vocab_size", str(VOCAB), "--trainer.run_dir", str(tmp_path / "run"), *overrides]
    config, _ = load_train_config([CONFIG], args)
    return prepare_run(config, ONE)


def test_a_run_over_the_limit_is_refused_with_the_estimate_the_limit_and_a_change_that_fits(tmp_path, monkeypatch):
    setup = _setup(tmp_path, "--trainer.train_batch_size", "32")  # 4 rows per device: 2 halve the activations
    planner = Planner(setup.config, DeviceSpec("cpu:8", 8, None, cpu_memory_bytes=GiB), VOCAB)
    estimate = planner.estimate(setup.config).peak_bytes
    monkeypatch.setenv("LM_TRAIN_MEMORY_LIMIT", str(estimate - 1))
    with pytest.raises(OutOfMemoryError) as refused:
        check_before_compile(setup, LANGUAGE_MODELING)
    message = str(refused.value)
    assert estimate < MiB  # so the message gives it in KiB
    assert f"peak estimate is {estimate / 1024:.2f} KiB per device" in message
    assert f"limit is {(estimate - 1) / 1024:.2f} KiB per device (LM_TRAIN_MEMORY_LIMIT)" in message
    assert "nothing was compiled" in message and "--skip-memory-check" in message
    assert "--trainer.per_device_parallelism 2 (2 microbatches" in message  # half the rows at once: less memory
    assert "\n" not in message and not (tmp_path / "run").exists()

    monkeypatch.setenv("LM_TRAIN_MEMORY_LIMIT", str(estimate))
    assert check_before_compile(setup, LANGUAGE_MODELING).estimate == estimate  # just fits
    monkeypatch.setenv("LM_TRAIN_MEMORY_LIMIT", str(estimate - 1))
    monkeypatch.setenv("LM_TRAIN_SKIP_MEMORY_CHECK", "1")
    assert check_before_compile(setup, LANGUAGE_MODELING).skip


def test_the_estimate_is_kept_so_a_rerun_traces_nothing(tmp_path, monkeypatch):
    setup = _setup(tmp_path)
    first = check_before_compile(setup, LANGUAGE_MODELING).estimate

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(Planner, "estimate", no_trace)
    again = dataclasses.replace(setup, config=_setup(tmp_path / "other-run").config)  # another run dir: same step
    assert check_before_compile(again, LANGUAGE_MODELING).estimate == first
    with pytest.raises(AssertionError, match="traced again"):  # another batch: traced
        check_before_compile(_setup(tmp_path, "--trainer.train_batch_size", "16"), LANGUAGE_MODELING)


def _peak_of(compiled) -> int:
    a = compiled.memory_analysis()
    return a.argument_size_in_bytes + a.output_size_in_bytes - a.alias_size_in_bytes + a.temp_size_in_bytes


def test_xlas_compiled_figure_is_checked_against_the_limit():
    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    compiled = jax.jit(lambda a: jnp.tanh(a @ a) @ a).lower(x).compile()
    peak = _peak_of(compiled)
    assert peak >= 2 * 512 * 512 * 4  # its argument and its result, at least

    MemoryGuard(MemoryLimit(peak, "test")).check_compiled(compiled)  # exactly fits
    guard = MemoryGuard(MemoryLimit(peak - 1, "a test's limit"), estimate=MiB // 2)
    with pytest.raises(OutOfMemoryError) as refused:
        guard.check_compiled(compiled)
    message = str(refused.value)
    assert f"XLA's compiled train step needs {peak / MiB:.2f} MiB per device" in message
    assert "the plan estimated 512.00 KiB" in message and "a test's limit" in message and "no step was run" in message
    MemoryGuard(MemoryLimit(peak - 1, "test"), skip=True).check_compiled(compiled)


def test_an_out_of_memory_while_running_is_one_paragraph_and_exit_2(tmp_path, monkeypatch):
    import lm_train.run.loop

    reached = []

    def step_that_runs_out(setup, config, kind, guard):
        reached.append(guard.estimate)
        raise jax.errors.JaxRuntimeError(OOM)  # the type and text XLA's allocator raises

    monkeypatch.setattr(lm_train.run.loop, "_train", step_that_runs_out)
    args = [*TINY, "--data.vocab_size", str(VOCAB), "--trainer.run_dir", str(tmp_path / "run")]
    result = CliRunner().invoke(app, ["run", str(CONFIG), *args])
    assert result.exit_code == 2, result.output
    assert reached and reached[0] > 0  # the estimate was made, and fit
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if "out of memory" in line]
    assert line.startswith("error: the run ran out of memory: an allocation of 24.18 GiB failed")
    assert "the plan estimated a peak of" in line and "the limit is" in line
    assert result.output.count("ran out of memory") == 1

    def other_failure(setup, config, kind, guard):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(lm_train.run.loop, "_train", other_failure)
    result = CliRunner().invoke(app, ["run", str(CONFIG), *args])
    assert isinstance(result.exception, jax.errors.JaxRuntimeError)  # not every runtime error is a lack of memory


def test_a_run_refused_before_compiling_exits_2_without_a_traceback(tmp_path, monkeypatch):
    import lm_train.run.loop

    def must_not_start(*args):
        raise AssertionError("the run went on to data, state and compile")

    monkeypatch.setattr(lm_train.run.loop, "_train", must_not_start)
    monkeypatch.setenv("LM_TRAIN_MEMORY_LIMIT", "64KiB")
    args = [*TINY, "--data.vocab_size", str(VOCAB), "--trainer.run_dir", str(tmp_path / "run")]
    result = CliRunner().invoke(app, ["run", str(CONFIG), *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "error: this run will not fit in memory: the plan's peak estimate is" in result.output
    assert "the limit is 64.00 KiB per device (LM_TRAIN_MEMORY_LIMIT)" in result.output
    assert not (tmp_path / "run").exists()


def test_the_loss_is_blockwise_on_cpu_where_one_microbatchs_logits_would_not_fit(tmp_path):
    setup = _setup(tmp_path, "--trainer.per_device_parallelism", "1")
    config, rows = setup.config, 1
    full_logits = rows * config.model.seq_len * VOCAB * 4  # one sequence's float32 logits on one device
    assert with_loss_blocks(config, VOCAB, rows, "cpu", full_logits) is config  # fits: as it was
    assert with_loss_blocks(config, VOCAB, rows, "gpu", full_logits - 1) is config  # lm_models' own rule there
    blocked = with_loss_blocks(config, VOCAB, rows, "cpu", full_logits - 1)
    assert blocked.model.cross_entropy_block_size == 8192
    given = dataclasses.replace(config, model=dataclasses.replace(config.model, cross_entropy_block_size=16))
    assert with_loss_blocks(given, VOCAB, rows, "cpu", 1) is given  # a size the user gave stays

    # The plan on CPU devices too small for the logits scores in blocks, and holds no (rows, seq, vocab) buffer.
    vocab = 200_000
    small = DeviceSpec("cpu:8", 8, None, cpu_memory_bytes=8 * (config.model.seq_len * vocab * 4 - 1))
    plan = make_plan(config, small, vocab_size=vocab, vocab_from="test", peak_flops=1e12)
    roomy = make_plan(config, dataclasses.replace(small, cpu_memory_bytes=64 * GiB), vocab_size=vocab,
                      vocab_from="test", peak_flops=1e12)  # fmt: skip
    assert (plan.cross_entropy_block_size, roomy.cross_entropy_block_size) == (8192, None)
    assert roomy.estimate.logits_bytes >= config.model.seq_len * vocab * 4
    assert plan.estimate.logits_bytes < config.model.seq_len * vocab * 4
    assert any("blocks of 8192" in note for note in plan.notes)


def test_a_run_records_the_loss_blocks_it_chose(tmp_path, monkeypatch):
    setup = _setup(tmp_path, "--trainer.per_device_parallelism", "1")
    assert with_run_loss_blocks(setup).config.model.cross_entropy_block_size is None  # 16 x 64 logits fit here
    rows = 8 // setup.plan.data_size  # per device, one microbatch
    monkeypatch.setenv("LM_TRAIN_MEMORY_LIMIT", str(math.prod((rows, setup.config.model.seq_len, VOCAB, 4)) - 1))
    assert with_run_loss_blocks(setup).config.model.cross_entropy_block_size == 8192
