"""What one step trains on: token ids, the optional per-token fields of packed and SFT data, and a kind's own fields.

On the host a batch is a dict of numpy arrays (this process's rows); in the step it is a `TokenBatch` of
NamedArrays. A plain pretraining batch has `input_ids` alone, and its step is the same program as ever. A kind of
training (lm_train.run.training_kind) declares the fields it adds as `BatchField`s; they travel in `TokenBatch.extra`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import numpy as np

import named_tensors as nt


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One field of a batch: its dtype, and whether it holds a value per token (batch, position) or per example."""

    dtype: Any
    per_token: bool = True


CORE_FIELDS: Mapping[str, BatchField] = {
    "input_ids": BatchField(np.int32),
    "loss_mask": BatchField(np.bool_),
    "segment_ids": BatchField(np.int32),
    "positions": BatchField(np.int32),
}
"""The fields every kind of training may have: ids, and what packed rows and SFT's masks add."""


class TokenBatch(eqx.Module):
    """A batch in the step: ids (batch, position) and the fields the data provides (None where it does not)."""

    input_ids: nt.NamedArray
    loss_mask: nt.NamedArray | None = None
    """Whether the prediction made at each position counts (completion and assistant tokens in SFT)."""
    segment_ids: nt.NamedArray | None = None
    """Which packed document each position belongs to (-1: padding); attention stays inside a document."""
    positions: nt.NamedArray | None = None
    """Each token's position within its document (restarting at 0 in packed sequences)."""
    extra: dict[str, nt.NamedArray] = eqx.field(default_factory=dict)
    """The fields a kind of training adds, by name (its `extra_fields`); empty for language modelling."""
    targets: nt.NamedArray | None = None
    """The id each position predicts, when the positions were reordered (context parallelism's load balance)."""

    def loss_inputs(self) -> dict[str, Any]:
        """The keyword arguments of lm_models.next_token_loss that this batch sets."""
        out: dict[str, Any] = {}
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask
        if self.segment_ids is not None:
            out["attn_mask"] = nt.nn.AttentionMask.packed(self.segment_ids)
        if self.positions is not None:
            out["positions"] = self.positions
        if self.targets is not None:
            out["targets"] = self.targets
        return out


def as_host_batch(
    local: np.ndarray | Mapping[str, np.ndarray], fields: Mapping[str, BatchField] = CORE_FIELDS
) -> dict[str, np.ndarray]:
    """A data source's batch as a dict of numpy arrays with the step's dtypes (a bare array is `input_ids`)."""
    given = {"input_ids": local} if isinstance(local, np.ndarray) else dict(local)
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ValueError(f"unknown batch fields {unknown}; a batch of this kind of training has {sorted(fields)}")
    return {name: np.asarray(value, fields[name].dtype) for name, value in given.items()}


def named_batch(
    arrays: Mapping[str, Any], batch_axis: str, Pos: nt.Axis, fields: Mapping[str, BatchField] = CORE_FIELDS
) -> TokenBatch:
    """The step's TokenBatch from global arrays keyed by field (`fields`: what each one is)."""
    Batch = nt.Axis(batch_axis, arrays["input_ids"].shape[0])
    named = {
        name: nt.NamedArray(array, (Batch, Pos) if fields[name].per_token else (Batch,))
        for name, array in arrays.items()
    }
    core = {name: value for name, value in named.items() if name in CORE_FIELDS}
    return TokenBatch(**core, extra={name: value for name, value in named.items() if name not in CORE_FIELDS})
