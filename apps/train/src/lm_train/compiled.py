"""The train step compiled once, with explicit shardings for every array of the state.

Fresh and resumed runs then execute the same program on the same layouts, which is what makes a resumed run
bitwise-equal to an uninterrupted one (a jit that let the partitioner pick output layouts could compile a
second variant after the first step, and a resumed run would start with the other one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

import named_tensors as nt
from lm_train.mesh import MeshPlan


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
    """`(state, local batch) -> (state, metrics)`: one executable, state donated, layouts fixed."""

    def __init__(
        self,
        step_fn: Callable[[Any, nt.NamedArray], tuple[Any, dict[str, jax.Array]]],
        layout: StateLayout,
        plan: MeshPlan,
        Pos: nt.Axis,
        batch_axis: str,
    ):
        self.layout = layout
        self.plan = plan
        self.Pos = Pos
        self.batch_axis = batch_axis

        def run(arrays: Any, batch: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
            ids = nt.NamedArray(batch, (nt.Axis(batch_axis, batch.shape[0]), Pos))
            with nt.axis_mapping(plan.compute_mapping, mesh=plan.mesh):
                new_state, metrics = step_fn(layout.state(arrays), ids)
            return layout.arrays(new_state), metrics

        self._jitted = jax.jit(
            run,
            in_shardings=(layout.shardings, plan.batch_sharding()),
            out_shardings=(layout.shardings, plan.replicated()),
            donate_argnums=0,
        )

    def lower(self, state: Any, global_batch_size: int) -> jax.stages.Lowered:
        """The step lowered for a state (its arrays, or its shapes: the target) and a global batch size."""
        batch = jax.ShapeDtypeStruct((global_batch_size, self.Pos.size), np.int32, sharding=self.plan.batch_sharding())
        return self._jitted.lower(self.layout.arrays(state), batch)

    def precompile(self, state: Any, global_batch_size: int) -> None:
        """Compile for this state and batch size now (e.g. while the first batch loads): the first call reuses it.

        jit keeps the executable that `lower(...).compile()` built for the same arguments' shapes, dtypes and
        shardings, so the step that runs is the same program, only compiled earlier.
        """
        self.lower(state, global_batch_size).compile()

    def device_batch(self, local: np.ndarray) -> jax.Array:
        """This process's rows, assembled into the global batch array sharded over the data axis."""
        return jax.make_array_from_process_local_data(self.plan.batch_sharding(), np.asarray(local, np.int32))

    def __call__(self, state: Any, local: np.ndarray) -> tuple[Any, dict[str, jax.Array]]:
        arrays, metrics = self._jitted(self.layout.arrays(state), self.device_batch(local))
        return self.layout.state(arrays), metrics
