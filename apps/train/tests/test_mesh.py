"""The mesh plan: axis sizes, mappings, and the errors for batches that do not fit."""

import jax
import pytest

from lm_train.config import TrainerConfig
from lm_train.errors import ConfigError
from lm_train.run.mesh import check_batch_fits, plan_mesh


def test_fsdp_and_tensor_parallel_mappings():
    plan = plan_mesh(TrainerConfig(model_axis_size=2))
    assert dict(plan.mesh.shape) == {
        "replica": 1,
        "stage": 1,
        "data": len(jax.devices()) // 2,
        "context": 1,
        "expert": 1,
        "model": 2,
    }
    assert plan.param_mapping == {"mlp": "model", "heads": "model", "kv_heads": "model", "embed": "data"}
    assert plan.compute_mapping == {
        "batch": ("replica", "data"),
        "mlp": "model",
        "heads": "model",
        "kv_heads": "model",
    }


def test_single_axis_has_no_tensor_parallelism():
    plan = plan_mesh(TrainerConfig(model_axis_size=1, fsdp_axis=None))
    assert plan.param_mapping == {} and plan.compute_mapping == {"batch": ("replica", "data")}


def test_model_axis_must_divide_devices():
    with pytest.raises(ConfigError, match="model_axis_size=3 does not divide the 8 devices"):
        plan_mesh(TrainerConfig(model_axis_size=3))


def test_context_axis_splits_positions_and_the_data_axis_takes_the_rest():
    plan = plan_mesh(TrainerConfig(context_axis_size=4))
    assert dict(plan.mesh.shape) == {"replica": 1, "stage": 1, "data": 2, "context": 4, "expert": 1, "model": 1}
    assert plan.context_size == 4 and plan.data_size == 2
    assert plan.compute_mapping == {"batch": ("replica", "data"), "position": "context"}
    assert plan.param_mapping == {"embed": "data"}
    explicit = plan_mesh(TrainerConfig(mesh={"data": 2, "context": -1}))
    assert dict(explicit.mesh.shape) == {"replica": 1, "stage": 1, "data": 2, "context": 4, "expert": 1, "model": 1}
    with pytest.raises(ConfigError, match=r"model_axis_size=4 = 16 does not divide the 8"):
        plan_mesh(TrainerConfig(context_axis_size=4, model_axis_size=4))
    with pytest.raises(ConfigError, match=r"trainer\.context_axis_size must be at least 1"):
        TrainerConfig(context_axis_size=0)


def test_batch_must_divide_over_data_axis():
    plan = plan_mesh(TrainerConfig(model_axis_size=2))
    with pytest.raises(ConfigError, match="train_batch_size=6 does not divide over the 4 data-parallel devices"):
        check_batch_fits(TrainerConfig(train_batch_size=6, model_axis_size=2), plan, 1)


def test_microbatches():
    plan = plan_mesh(TrainerConfig())
    assert check_batch_fits(TrainerConfig(train_batch_size=32), plan, 1) == 1
    assert check_batch_fits(TrainerConfig(train_batch_size=32, per_device_parallelism=2), plan, 1) == 2
    with pytest.raises(ConfigError, match="per_device_parallelism=3"):
        check_batch_fits(TrainerConfig(train_batch_size=32, per_device_parallelism=3), plan, 1)


def test_explicit_mesh_with_the_rest_and_hybrid_sharding():
    plan = plan_mesh(TrainerConfig(mesh={"replica": 2, "data": -1, "model": 2}))
    assert dict(plan.mesh.shape) == {"replica": 2, "stage": 1, "data": 2, "context": 1, "expert": 1, "model": 2}
    assert plan.data_size == 4 and plan.param_mapping["embed"] == "data"
    assert check_batch_fits(TrainerConfig(train_batch_size=8), plan, 1) == 1


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ({"data": 3, "model": 2}, "has 6 devices but there are 8"),
        ({"data": -1, "model": -1}, "at most one -1"),
        ({"dat": 8}, "unknown mesh axes \\['dat'\\]"),
        ({"data": -1, "model": 3}, "3 does not divide the 8 devices"),
    ],
)
def test_bad_explicit_mesh(mesh, message):
    with pytest.raises(ConfigError, match=message):
        plan_mesh(TrainerConfig(mesh=mesh))


def test_axis_resource_overrides():
    plan = plan_mesh(
        TrainerConfig(
            model_axis_size=2,
            axis_resources={"position": "model"},
            parameter_axis_resources={"embed": None, "vocab": ["data", "model"]},
        )
    )
    assert plan.compute_mapping["position"] == "model"
    assert plan.param_mapping["embed"] is None and plan.param_mapping["vocab"] == ["data", "model"]
    with pytest.raises(ConfigError, match=r"trainer.axis_resources.mlp: unknown mesh axis"):
        plan_mesh(TrainerConfig(axis_resources={"mlp": "tensor"}))


def test_expert_axis_borrows_data_parallel_devices_and_splits_the_experts():
    plan = plan_mesh(TrainerConfig(expert_axis_size=4))
    assert dict(plan.mesh.shape) == {"replica": 1, "stage": 1, "data": 2, "context": 1, "expert": 4, "model": 1}
    assert plan.param_mapping == {"experts": "expert", "embed": "data"}
    assert plan.compute_mapping == {"batch": ("replica", "data", "expert"), "experts": "expert"}
    # Each device routes its own tokens: the batch splits over all 8 devices.
    assert plan.data_size == 8 and plan.batch_sharding().spec[0] == ("replica", "data", "expert")
    assert check_batch_fits(TrainerConfig(train_batch_size=16, per_device_parallelism=1), plan, 1) == 2
    explicit = plan_mesh(TrainerConfig(mesh={"data": -1, "expert": 2, "model": 2}))
    assert dict(explicit.mesh.shape) == {"replica": 1, "stage": 1, "data": 2, "context": 1, "expert": 2, "model": 2}
    assert explicit.compute_mapping["experts"] == "expert" and explicit.compute_mapping["mlp"] == "model"


def test_impossible_expert_layouts_name_every_size():
    with pytest.raises(ConfigError, match=r"expert_axis_size=3 does not divide the 8 devices"):
        plan_mesh(TrainerConfig(expert_axis_size=3))
    message = r"trainer.expert_axis_size=4 x trainer.model_axis_size=4 = 16 does not divide the 8 devices"
    with pytest.raises(ConfigError, match=message):
        plan_mesh(TrainerConfig(expert_axis_size=4, model_axis_size=4))
    with pytest.raises(ConfigError, match=r"trainer.expert_axis_size must be at least 1"):
        TrainerConfig(expert_axis_size=0)
