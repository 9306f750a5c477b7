"""The kind of training a plan is for: `lm-train run`'s step, or `lm-train dpo`'s (pairs of sequences, and a frozen
reference model in the compute dtype beside the state)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from lm_train.config.schema import TrainLmConfig
from lm_train.data.sft_data import example_fields
from lm_train.objectives import Objective
from lm_train.precision import parse_policy


@dataclass(frozen=True)
class PlannedKind:
    """What the traced step, its batch and its speed depend on beside the config."""

    dpo: bool = False

    @property
    def name(self) -> str:
        return "lm-train dpo" if self.dpo else "lm-train run"

    def objective(self, config: TrainLmConfig) -> Objective | None:
        """What the step differentiates (None: the next-token loss)."""
        if not self.dpo:
            return None
        from lm_train.dpo.loss import dpo_objective

        return dpo_objective(config.dpo.beta)

    def batch_fields(self, config: TrainLmConfig) -> tuple[str, ...]:
        """The fields of the run's batches. Packed rows bring segment ids, positions and a loss mask, which decide
        the attention kernels and the batch's bytes; DPO's pairs, a chosen and a rejected sequence."""
        if self.dpo:
            from lm_train.dpo.data import PAIR_FIELDS

            return PAIR_FIELDS
        return ("input_ids",) if config.data.is_mixture else example_fields(config.data)

    @property
    def sequences_per_example(self) -> int:
        return self._training().sequences_per_example

    @property
    def flops_scale(self) -> float:
        """Training FLOPs per token relative to the model's forward and backward (DPO adds the reference's
        forward: 8N against 6N)."""
        return self._training().flops_scale

    def _training(self) -> Any:
        """The TrainingKind that `lm-train run` or `lm-train dpo` gives the loop: its figures are the run's."""
        if self.dpo:
            from lm_train.dpo.training import DPO

            return DPO
        from lm_train.training_kind import LANGUAGE_MODELING

        return LANGUAGE_MODELING

    def with_reference(self, state: Any, config: TrainLmConfig) -> Any:
        """The state's shapes with DPO's frozen reference model: the model's floating arrays in the compute dtype
        (as the policy casts them), on the same shardings, if any."""
        if not self.dpo:
            return state
        compute = parse_policy(config.trainer.mp).compute_dtype

        def cast(x: Any) -> Any:
            if isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating):
                return jax.ShapeDtypeStruct(x.shape, compute, sharding=x.sharding)
            return x

        return dataclasses.replace(state, reference=jax.tree.map(cast, state.model))


RUN = PlannedKind()
