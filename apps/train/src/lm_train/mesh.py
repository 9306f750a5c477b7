"""The device mesh and the axis mappings (parameters vs compute) of a run, from the trainer config."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import named_tensors as nt
from lm_train.config.schema import TrainerConfig
from lm_train.errors import ConfigError

DATA = "data"
MODEL = "model"


@dataclass(frozen=True)
class MeshPlan:
    """A mesh plus how logical axis names map onto it for parameters and for computation."""

    mesh: Mesh
    param_mapping: dict[str, str]
    compute_mapping: dict[str, str]

    @property
    def data_size(self) -> int:
        return self.mesh.shape[DATA]

    @property
    def model_size(self) -> int:
        return self.mesh.shape[MODEL]

    def batch_sharding(self) -> NamedSharding:
        """How a (batch, position) array of token ids is laid out: batch over the data axis."""
        return NamedSharding(self.mesh, PartitionSpec(DATA, None))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def plan_mesh(config: TrainerConfig, devices: list[jax.Device] | None = None) -> MeshPlan:
    """`data` x `model` mesh over all devices; FSDP puts `fsdp_axis` on data, TP puts its axes on model."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    if n % config.model_axis_size:
        raise ConfigError(
            f"trainer.model_axis_size={config.model_axis_size} does not divide the {n} devices; "
            f"choose a divisor of {n}."
        )
    data = n // config.model_axis_size
    mesh = Mesh(np.array(devices).reshape(data, config.model_axis_size), (DATA, MODEL))
    tensor_parallel = {axis: MODEL for axis in config.tensor_parallel_axes} if config.model_axis_size > 1 else {}
    param_mapping = dict(tensor_parallel)
    if config.fsdp_axis:
        param_mapping[config.fsdp_axis] = DATA
    compute_mapping = {config.batch_axis: DATA, **tensor_parallel}
    return MeshPlan(mesh, param_mapping, compute_mapping)


def check_batch_fits(config: TrainerConfig, plan: MeshPlan, process_count: int) -> int:
    """The number of microbatches; a clear error when the batch does not divide over devices."""
    batch = config.train_batch_size
    if batch % plan.data_size:
        raise ConfigError(
            f"trainer.train_batch_size={batch} does not divide over the {plan.data_size} data-parallel devices "
            f"({len(plan.mesh.devices.flat)} devices / model_axis_size {plan.model_size}). Use a multiple of "
            f"{plan.data_size}."
        )
    if batch % process_count:
        raise ConfigError(f"trainer.train_batch_size={batch} does not divide over {process_count} processes.")
    per_device = config.per_device_parallelism
    if per_device == -1:
        return 1
    microbatch = per_device * plan.data_size
    if per_device < 1 or batch % microbatch:
        raise ConfigError(
            f"trainer.per_device_parallelism={per_device} gives microbatches of {microbatch} examples, which do "
            f"not divide trainer.train_batch_size={batch}. Use -1 (no accumulation) or a divisor of "
            f"{batch // plan.data_size}."
        )
    return batch // microbatch


__all__ = ["MeshPlan", "check_batch_fits", "nt", "plan_mesh"]
