"""The train step compiled once, with explicit shardings for every array of the state.

Fresh and resumed runs then execute the same program on the same layouts, which is what makes a resumed run
bitwise-equal to an uninterrupted one (a jit that let the partitioner pick output layouts could compile a
second variant after the first step, and a resumed run would start with the other one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding

import named_tensors as nt
from lm_train.run.batch import CORE_FIELDS, BatchField, TokenBatch, as_host_batch, named_batch
from lm_train.run.mesh import MeshPlan


def _is_shape(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


class StateLayout:
    """Splits a state into its arrays (with their shardings) and the static rest, and back."""

    def __init__(self, target: Any):
        shapes, self.static = eqx.partition(target, _is_shape)
        self.shardings = jax.tree_util.tree_map(lambda s: s.sharding, shapes)

    def arrays(self, state: Any) -> Any:
        """The array leaves of a state, or of its shapes (None elsewhere), structured like `shardings`."""
        return eqx.partition(state, lambda x: eqx.is_array(x) or _is_shape(x))[0]

    def state(self, arrays: Any) -> Any:
        return eqx.combine(arrays, self.static)


class CompiledStep:
    """`(state, local batch) -> (state, metrics)`: one executable, state donated, layouts fixed.

    A local batch is this process's rows: an int32 array of ids, or a dict of `fields` (default CORE_FIELDS; a
    kind of training adds its own).
    """

    def __init__(
        self,
        step_fn: Callable[[Any, TokenBatch], tuple[Any, dict[str, jax.Array]]],
        layout: StateLayout,
        plan: MeshPlan,
        Pos: nt.Axis,
        batch_axis: str,
        fields: Mapping[str, BatchField] = CORE_FIELDS,
    ):
        self.layout = layout
        self.fields = fields
        self.plan = plan
        self.Pos = Pos
        self.batch_axis = batch_axis

        def run(arrays: Any, batch: dict[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
            with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
                new_state, metrics = step_fn(layout.state(arrays), named_batch(batch, batch_axis, Pos, fields))
            return layout.arrays(new_state), metrics

        self._run = run
        self._jitted: dict[tuple[str, ...], Any] = {}

    def _program(self, fields: tuple[str, ...]) -> Any:
        """The jitted step for batches with these fields (one per run in practice), shardings all given."""
        fields = tuple(sorted(fields))
        if fields not in self._jitted:
            # Every field of a batch is split over the data axes along its first (example) dimension.
            batch_shardings = {name: self._sharding(2 if self.fields[name].per_token else 1) for name in fields}
            self._jitted[fields] = jax.jit(
                self._run,
                in_shardings=(self.layout.shardings, batch_shardings),
                out_shardings=(self.layout.shardings, self.plan.replicated()),
                donate_argnums=0,
            )
        return self._jitted[fields]

    def _sharding(self, ndim: int) -> NamedSharding:
        return self.plan.batch_sharding() if ndim == 2 else self.plan.example_sharding()

    def lower(self, state: Any, global_batch_size: int, fields: tuple[str, ...] = ("input_ids",)) -> jax.stages.Lowered:
        """The step lowered for a state (its arrays, or its shapes: the target), a global batch size and fields."""
        batch = {}
        for name in fields:
            spec = self.fields[name]
            shape = (global_batch_size, self.Pos.size) if spec.per_token else (global_batch_size,)
            batch[name] = jax.ShapeDtypeStruct(shape, spec.dtype, sharding=self._sharding(len(shape)))
        return self._program(tuple(batch)).lower(self.layout.arrays(state), batch)

    def precompile(
        self, state: Any, global_batch_size: int, fields: tuple[str, ...] = ("input_ids",)
    ) -> jax.stages.Compiled:
        """Compile for this state, batch size and batch fields now (e.g. while the first batch loads); returns the
        executable, whose memory_analysis() is XLA's figure for it.

        jit keeps the executable that `lower(...).compile()` built for the same arguments' shapes, dtypes and
        shardings, so the step that runs is the same program, only compiled earlier.
        """
        return self.lower(state, global_batch_size, fields).compile()

    def device_batch(self, local: np.ndarray | Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of every field, assembled into global arrays sharded over the data axes."""
        return {
            name: jax.make_array_from_process_local_data(self._sharding(value.ndim), value)
            for name, value in as_host_batch(local, self.fields).items()
        }

    def __call__(self, state: Any, local: np.ndarray | Mapping[str, np.ndarray]) -> tuple[Any, dict[str, jax.Array]]:
        batch = self.device_batch(local)
        arrays, metrics = self._program(tuple(batch))(self.layout.arrays(state), batch)
        return self.layout.state(arrays), metrics
