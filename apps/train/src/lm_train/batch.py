"""What one step trains on: token ids, and the optional per-token fields that post-training and mixtures add.

On the host a batch is a dict of numpy arrays (this process's rows); in the step it is a `TokenBatch` of
NamedArrays. A plain pretraining batch has `input_ids` alone, and its step is the same program as ever.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import numpy as np

import named_tensors as nt

TOKEN_FIELDS = ("input_ids", "loss_mask", "segment_ids", "positions", "rejected_input_ids", "rejected_loss_mask")
"""Fields of shape (batch, position)."""
EXAMPLE_FIELDS = ("source_ids",)
"""Fields of shape (batch,): one value per example (e.g. which mixture source it came from)."""
FIELD_DTYPES = {"input_ids": np.int32, "loss_mask": np.bool_, "segment_ids": np.int32, "positions": np.int32}
FIELD_DTYPES["source_ids"] = np.int32
FIELD_DTYPES.update(rejected_input_ids=np.int32, rejected_loss_mask=np.bool_)  # DPO: a pair's second sequence


class TokenBatch(eqx.Module):
    """A batch in the step: ids (batch, position) and the fields the data provides (None where it does not)."""

    input_ids: nt.NamedArray
    loss_mask: nt.NamedArray | None = None
    """Whether the prediction made at each position counts (completion and assistant tokens in SFT)."""
    segment_ids: nt.NamedArray | None = None
    """Which packed document each position belongs to (-1: padding); attention stays inside a document."""
    positions: nt.NamedArray | None = None
    """Each token's position within its document (restarting at 0 in packed sequences)."""
    source_ids: nt.NamedArray | None = None
    """Per example (batch,): the mixture source it was drawn from."""
    rejected_input_ids: nt.NamedArray | None = None
    """DPO: the rejected sequence of each pair (input_ids and loss_mask then hold the chosen one)."""
    rejected_loss_mask: nt.NamedArray | None = None

    def loss_inputs(self) -> dict[str, Any]:
        """The keyword arguments of lm_models.next_token_loss that this batch sets."""
        out: dict[str, Any] = {}
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask
        if self.segment_ids is not None:
            out["attn_mask"] = nt.nn.AttentionMask.packed(self.segment_ids)
        if self.positions is not None:
            out["positions"] = self.positions
        return out


def as_host_batch(local: np.ndarray | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A data source's batch as a dict of numpy arrays with the step's dtypes (a bare array is `input_ids`)."""
    fields = {"input_ids": local} if isinstance(local, np.ndarray) else dict(local)
    unknown = sorted(set(fields) - set(FIELD_DTYPES))
    if unknown:
        raise ValueError(f"unknown batch fields {unknown}; a batch has {sorted(FIELD_DTYPES)}")
    return {name: np.asarray(value, FIELD_DTYPES[name]) for name, value in fields.items()}


def named_batch(arrays: Mapping[str, Any], batch_axis: str, Pos: nt.Axis) -> TokenBatch:
    """The step's TokenBatch from global arrays keyed by field."""
    Batch = nt.Axis(batch_axis, arrays["input_ids"].shape[0])
    named = {
        name: nt.NamedArray(array, (Batch, Pos) if name in TOKEN_FIELDS else (Batch,)) for name, array in arrays.items()
    }
    return TokenBatch(**named)
