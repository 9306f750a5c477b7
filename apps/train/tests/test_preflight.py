"""prepare_run decides the mesh, step settings, optimizer and resume point, and rejects bad configs, without data."""

from __future__ import annotations

import pytest

from lm_train.errors import ConfigError
from lm_train.run.distributed import DistributedInfo
from lm_train.run.preflight import prepare_run

ONE = DistributedInfo(0, 1, "test")


def test_a_good_config_is_decided_without_data(make_config, tmp_path):
    config = make_config("--trainer.run_dir", str(tmp_path / "run"), "--trainer.per_device_parallelism", "1")
    setup = prepare_run(config, ONE)
    assert setup.plan.data_size == 8 and setup.step_settings.microbatches == 1
    assert setup.resume_from is None and setup.is_main and (setup.part.index, setup.part.count) == (0, 1)
    assert setup.optimizer.hessian_update is None
    assert not (tmp_path / "run").exists()  # deciding writes nothing


def test_scan_unroll_auto_is_decided_for_these_devices_and_the_policy(make_config):
    # What config.yaml records: gpt2_nano has no remat, so on these CPUs its scan runs every layer unrolled.
    assert make_config().model.scan_unroll == "auto"
    assert prepare_run(make_config(), ONE).config.model.scan_unroll is True
    assert prepare_run(make_config("--model.gradient_checkpointing", "true"), ONE).config.model.scan_unroll == 1
    assert prepare_run(make_config("--model.scan_unroll", "2"), ONE).config.model.scan_unroll == 2  # given: kept


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--trainer.train_batch_size", "12"], "train_batch_size=12 does not divide"),
        (["--trainer.per_device_eval_parallelism", "3", "--trainer.train_batch_size", "8"], None),
        (["--trainer.mp", "p=f32,c=float7"], r"trainer\.mp"),
        (["--trainer.model_axis_size", "3"], "model_axis_size=3 does not divide"),
        (["--initialize_from_hf", "/nonexistent/model"], "initialize_from_hf: /nonexistent/model"),
    ],
)
def test_bad_configs_fail_fast_and_name_the_key(make_config, overrides, message):
    config = make_config(*overrides)
    if message is None:  # 3 per device * 8 devices = 24 divides everything: it is accepted
        assert prepare_run(config, ONE).plan.data_size == 8
        return
    with pytest.raises(ConfigError, match=message):
        prepare_run(config, ONE)


def test_eval_batches_must_divide_over_processes(make_config):
    config = make_config("--trainer.per_device_eval_parallelism", "1", "--trainer.train_batch_size", "24")
    with pytest.raises(ConfigError, match="per_device_eval_parallelism=1"):
        prepare_run(config, DistributedInfo(0, 3, "test"))
