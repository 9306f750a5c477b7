"""The device mesh and the axis mappings (parameters vs compute) of a run, from the trainer config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lm_train.config.batch_sizes import padding_multiple, size_where
from lm_train.config.trainer_config import TrainerConfig
from lm_train.errors import ConfigError
from named_tensors.nn import EXPERTS

REPLICA = "replica"
STAGE = "stage"
DATA = "data"
CONTEXT = "context"
EXPERT = "expert"
MODEL = "model"
MESH_AXES = (REPLICA, STAGE, DATA, CONTEXT, EXPERT, MODEL)
LAYERS = "layers"  # the logical axis of a model's stacked layers, split over STAGE under pipeline parallelism
POSITION = "position"  # the logical axis that context parallelism splits
# The axes that split the batch: expert parallelism borrows data-parallel devices (each routes its own tokens).
BATCH_AXES = (REPLICA, DATA, EXPERT)


@dataclass(frozen=True)
class MeshPlan:
    """A mesh plus how logical axis names map onto it for parameters and for computation."""

    mesh: Mesh
    param_mapping: dict[str, Any]
    compute_mapping: dict[str, Any]

    @property
    def data_size(self) -> int:
        """Devices that hold different examples: the replica, data and expert axes together."""
        return batch_devices(self.mesh.shape)

    @property
    def model_size(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def stage_size(self) -> int:
        """Pipeline stages: the size of the stage axis."""
        return self.mesh.shape[STAGE]

    @property
    def context_size(self) -> int:
        """Devices that split each sequence's positions (ring attention): the context axis."""
        return self.mesh.shape[CONTEXT]

    def batch_sharding(self) -> NamedSharding:
        """How a (batch, position) array of token ids is laid out: batch over the replica, data (and expert) axes."""
        return NamedSharding(self.mesh, PartitionSpec(batch_mesh_axes(self.mesh.shape), None))

    def example_sharding(self) -> NamedSharding:
        """How a (batch,) array of per-example values is laid out: like the batch's first axis."""
        return NamedSharding(self.mesh, PartitionSpec(batch_mesh_axes(self.mesh.shape)))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def batch_mesh_axes(shape: Any) -> tuple[str, ...]:
    """The mesh axes that split the batch: replica and data, and expert where it has more than one device (a
    size-1 expert axis leaves the batch's sharding, and so the compiled program, as it was)."""
    return BATCH_AXES if shape.get(EXPERT, 1) > 1 else (REPLICA, DATA)


def batch_devices(shape: Any) -> int:
    """How many devices hold different examples in a mesh of this shape."""
    return int(np.prod([shape.get(axis, 1) for axis in BATCH_AXES]))


def mesh_shape(config: TrainerConfig, n: int) -> dict[str, int]:
    """Sizes of the mesh axes: from `trainer.mesh` if given, else the named sizes with the data axis taking the rest."""
    if config.mesh is None:
        named = {
            STAGE: config.pipeline_axis_size,
            CONTEXT: config.context_axis_size,
            EXPERT: config.expert_axis_size,
            MODEL: config.model_axis_size,
        }
        product = int(np.prod(list(named.values())))
        if n % product:
            if all(size == 1 for axis, size in named.items() if axis != MODEL):  # tensor parallelism alone
                raise ConfigError(
                    f"trainer.model_axis_size={config.model_axis_size} does not divide the {n} devices; "
                    f"choose a divisor of {n}."
                )
            parts = [f"trainer.{key}={value}" for key, value in _named_keys(config).items() if value > 1]
            sizes = parts[0] if len(parts) == 1 else f"{' x '.join(parts)} = {product}"
            raise ConfigError(
                f"{sizes} does not divide the {n} devices, so no data axis can take the rest. Choose "
                f"sizes whose product divides {n}."
            )
        return {
            REPLICA: 1,
            STAGE: named[STAGE],
            DATA: n // product,
            **{axis: named[axis] for axis in (CONTEXT, EXPERT, MODEL)},
        }
    unknown = sorted(set(config.mesh) - set(MESH_AXES))
    if unknown:
        raise ConfigError(f"trainer.mesh: unknown mesh axes {unknown}; the axes are {', '.join(MESH_AXES)}.")
    shape = {axis: int(config.mesh.get(axis, 1)) for axis in MESH_AXES}
    rest = [axis for axis, size in shape.items() if size == -1]
    if len(rest) > 1 or any(size == 0 or size < -1 for size in shape.values()):
        raise ConfigError(f"trainer.mesh={dict(config.mesh)}: sizes must be positive, with at most one -1.")
    known = int(np.prod([size for size in shape.values() if size != -1]))
    if rest:
        if n % known:
            raise ConfigError(f"trainer.mesh={dict(config.mesh)}: {known} does not divide the {n} devices.")
        shape[rest[0]] = n // known
    if int(np.prod(list(shape.values()))) != n:
        raise ConfigError(
            f"trainer.mesh={dict(config.mesh)} has {int(np.prod(list(shape.values())))} devices but there are {n}; "
            "use -1 for one axis to take the rest."
        )
    return shape


def _named_keys(config: TrainerConfig) -> dict[str, int]:
    """The trainer keys that name mesh axis sizes, and their values."""
    return {
        "pipeline_axis_size": config.pipeline_axis_size,
        "context_axis_size": config.context_axis_size,
        "expert_axis_size": config.expert_axis_size,
        "model_axis_size": config.model_axis_size,
    }


# jax.Device is a variable bound to a class of compiled jaxlib, which ships no stub: a jax stub gap.
def plan_mesh(config: TrainerConfig, devices: list[jax.Device] | None = None) -> MeshPlan:  # pyright: ignore[reportInvalidTypeForm]
    """`replica` x `data` x `expert` x `model` mesh over all devices, and the parameter and compute axis mappings.

    FSDP puts `fsdp_axis` on `data` (parameters are also replicated over `replica`: hybrid sharding); tensor
    parallelism puts its axes on `model`; expert parallelism puts the MoE `experts` axis on `expert`; the batch is
    split over `replica`, `data` and `expert`. `trainer.axis_resources`
    and `trainer.parameter_axis_resources` override entries of the compute and parameter mappings.
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(config, len(devices))
    mesh = Mesh(np.array(devices).reshape(tuple(shape.values())), tuple(shape))
    param_mapping, compute_mapping = axis_mappings(config, shape)
    return MeshPlan(mesh, param_mapping, compute_mapping)


def axis_mappings(config: TrainerConfig, shape: dict[str, int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameter and compute axis mappings of a mesh of this shape (see plan_mesh)."""
    tensor_parallel = {axis: MODEL for axis in config.tensor_parallel_axes} if shape[MODEL] > 1 else {}
    # Pipeline stages: each stage's contiguous chunk of the stacked layers lives on its stage's devices, and the
    # pipeline's (stage, ...) activation buffer is split the same way (lm_train.run.pipeline).
    stages = {LAYERS: STAGE, STAGE: STAGE} if shape.get(STAGE, 1) > 1 else {}
    # The experts' own axis: their weights live split over `expert`, and the MoE layer dispatches tokens to them.
    expert_parallel = {EXPERTS: EXPERT} if shape.get(EXPERT, 1) > 1 else {}
    param_mapping: dict[str, Any] = {**tensor_parallel, **({LAYERS: STAGE} if stages else {}), **expert_parallel}
    if config.fsdp_axis:
        param_mapping[config.fsdp_axis] = DATA
    compute_mapping: dict[str, Any] = {
        config.batch_axis: batch_mesh_axes(shape),
        **tensor_parallel,
        **stages,
        **expert_parallel,
    }
    if shape.get(CONTEXT, 1) > 1:
        # Activations' positions are split over the context axis; ring attention passes the keys around it.
        compute_mapping[POSITION] = CONTEXT
    for mapping, overrides, key in (
        (compute_mapping, config.axis_resources, "axis_resources"),
        (param_mapping, config.parameter_axis_resources, "parameter_axis_resources"),
    ):
        for logical, physical in (overrides or {}).items():
            targets = (physical,) if isinstance(physical, str) else tuple(physical or ())
            bad = [t for t in targets if t not in MESH_AXES]
            if bad:
                raise ConfigError(f"trainer.{key}.{logical}: unknown mesh axis {bad}; use {', '.join(MESH_AXES)}.")
            mapping[logical] = physical if physical else None
    return param_mapping, compute_mapping


def _stages_note(plan: MeshPlan) -> str:
    return f" / pipeline_axis_size {plan.stage_size}" if plan.stage_size > 1 else ""


def _context_note(plan: MeshPlan) -> str:
    return f" / context_axis_size {plan.context_size}" if plan.context_size > 1 else ""


def check_batch_fits(config: TrainerConfig, plan: MeshPlan, process_count: int) -> int:
    """The number of microbatches (of the largest batch size); a clear error when a batch size does not divide
    over the devices (unless trainer.allow_nondivisible_batch_size pads it) or into microbatches."""
    schedule = config.batch_schedule
    multiple = padding_multiple(plan.data_size, process_count)
    per_device = config.per_device_parallelism
    for size in schedule.distinct_sizes:
        where = size_where(schedule, size)
        if size % multiple and not config.allow_nondivisible_batch_size:
            if size % plan.data_size:
                raise ConfigError(
                    f"{where} does not divide over the {plan.data_size} data-parallel devices "
                    f"({plan.mesh.size} devices / model_axis_size {plan.model_size}{_stages_note(plan)}"
                    f"{_context_note(plan)}). Use a multiple of {plan.data_size}, or set "
                    "trainer.allow_nondivisible_batch_size: true to pad the batch with rows that count in no loss."
                )
            raise ConfigError(f"{where} does not divide over {process_count} processes.")
        if size % multiple and per_device != -1:
            raise ConfigError(
                f"{where} does not divide over the {plan.data_size} data-parallel devices, and a padded batch (trainer."
                f"allow_nondivisible_batch_size) is not split into microbatches: set trainer.per_device_parallelism "
                f"to -1, or use a multiple of {plan.data_size}."
            )
        if per_device == -1:
            continue
        microbatch = per_device * plan.data_size
        if per_device < 1 or size % microbatch:
            raise ConfigError(
                f"trainer.per_device_parallelism={per_device} gives microbatches of {microbatch} examples, which do "
                f"not divide {where}. Use -1 (no accumulation) or a divisor of {size // plan.data_size}."
            )
    if per_device == -1:
        return 1
    return schedule.largest // (per_device * plan.data_size)


__all__ = [
    "BATCH_AXES",
    "CONTEXT",
    "EXPERT",
    "LAYERS",
    "MESH_AXES",
    "POSITION",
    "STAGE",
    "MeshPlan",
    "axis_mappings",
    "batch_devices",
    "batch_mesh_axes",
    "check_batch_fits",
    "mesh_shape",
    "plan_mesh",
]
