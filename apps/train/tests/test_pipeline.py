"""Pipeline parallelism's config: the `stage` mesh axis, the schedule keys and the checks made before compiling."""

import jax
import numpy as np
import pytest

import named_tensors as nt
from lm_train.config import TrainerConfig
from lm_train.config.trainer_config import PipelineConfig
from lm_train.errors import ConfigError
from lm_train.run.mesh import plan_mesh
from lm_train.run.pipeline import PipelineSchedule, join_microbatches, pipeline_schedule, split_microbatches
from lm_train.run.pipeline_checks import check_pipeline

from .conftest import tiny_config


def test_stage_axis_takes_its_share_and_data_takes_the_rest():
    plan = plan_mesh(TrainerConfig(pipeline_axis_size=2, model_axis_size=2))
    assert dict(plan.mesh.shape) == {"replica": 1, "stage": 2, "data": 2, "context": 1, "expert": 1, "model": 2}
    assert plan.param_mapping["layers"] == "stage" and plan.compute_mapping["stage"] == "stage"
    assert plan.data_size == 2 and plan.stage_size == 2
    # Size 1: no mapping names the stage axis, so the program is the one without it.
    plain = plan_mesh(TrainerConfig(model_axis_size=2))
    assert "layers" not in plain.param_mapping and "stage" not in plain.compute_mapping
    assert plan_mesh(TrainerConfig(mesh={"stage": 4, "data": -1})).mesh.shape["stage"] == 4


def test_impossible_sizes_are_refused_naming_every_size():
    with pytest.raises(
        ConfigError, match=r"pipeline_axis_size=3 x trainer.model_axis_size=2 = 6 does not divide the 8 devices"
    ):
        plan_mesh(TrainerConfig(pipeline_axis_size=3, model_axis_size=2))
    with pytest.raises(ConfigError, match="pipeline_axis_size must be at least 1"):
        TrainerConfig(pipeline_axis_size=0)


def test_schedule_keys():
    assert PipelineConfig().microbatches_for(4) == 8
    with pytest.raises(ConfigError, match="'1f1b' is not built; lm-train has gpipe"):
        PipelineConfig(schedule="1f1b")
    with pytest.raises(ConfigError, match="virtual_stages=2 needs the interleaved schedule"):
        PipelineConfig(virtual_stages=2)
    with pytest.raises(ConfigError, match="microbatches must be at least 1"):
        PipelineConfig(microbatches=0)
    schedule = pipeline_schedule(TrainerConfig(pipeline_axis_size=4))
    assert schedule == PipelineSchedule(4, 8, "gpipe") and schedule.bubble() == pytest.approx(3 / 11)
    assert pipeline_schedule(TrainerConfig()) is None


def test_checks_before_compiling():
    config = tiny_config("--trainer.pipeline_axis_size", "2", "--model.num_layers", "4")
    plan = plan_mesh(config.trainer)  # stage 2 x data 4: 8 rows, 4 microbatches of 2 rows need data 2 at most
    with pytest.raises(ConfigError, match=r"microbatches=4 microbatches over the 4 data-parallel devices"):
        check_pipeline(config, plan, 1)
    config = tiny_config(
        "--trainer.pipeline_axis_size", "2", "--model.num_layers", "3", "--trainer.pipeline.microbatches", "2"
    )
    with pytest.raises(ConfigError, match=r"model\.num_layers=3 does not split into trainer\.pipeline_axis_size=2"):
        check_pipeline(config, plan, 1)
    config = tiny_config(
        "--trainer.pipeline_axis_size", "2", "--model.num_layers", "4", "--trainer.pipeline.microbatches", "2"
    )
    check_pipeline(config, plan, 1)
    unrolled = tiny_config(
        "--trainer.pipeline_axis_size", "2", "--trainer.pipeline.microbatches", "2", "--model.scan_layers", "false"
    )
    with pytest.raises(ConfigError, match=r"Set model\.scan_layers to true"):
        check_pipeline(unrolled, plan, 1)


def test_microbatch_split_round_trips_and_interleaves_examples():
    x = nt.named(np.arange(24).reshape(6, 4), ("batch", "position"))
    split = split_microbatches(x, "batch", 3)
    assert split.axis_names == ("microbatch", "batch", "position") and split.array.shape == (3, 2, 4)
    assert split.array[1, :, 0].tolist() == [4, 16]  # examples 1 and 4: example j * 3 + i is in microbatch i
    assert np.array_equal(jax.device_get(join_microbatches(split).array), x.array)
