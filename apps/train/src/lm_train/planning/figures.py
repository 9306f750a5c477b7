"""What `lm-train plan` finds, as plain data: one estimate per traced variant, and the plan around it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Estimate:
    """One traced variant of the run: its peak per device and the parts of it."""

    policy: str
    per_device_parallelism: int
    model_axis_size: int
    peak_bytes: int
    argument_bytes: int
    temporary_bytes: int
    peak_at: str
    saved_activation_bytes: int
    logits_bytes: int
    attention_scores_bytes: int
    attention_scores_saved: int
    attention_kernels: list[str]
    executed_flops: float
    microbatches: int
    local_batch: int


@dataclass
class SamplingMemory:
    """What a kind's sampling holds beside the train step (RL's in-process serving engine), in bytes per device."""

    kv_cache_bytes: int
    kv_cache_note: str
    kept_bytes: int  # the rest of what the engine keeps between rollouts: penalty counts, a compute-dtype weight copy
    buffers_bytes: int  # the largest of its programs' temporaries and outputs, while it samples
    buffers_note: str
    decode_bytes: int = 0
    prefill_bytes: int = 0

    def peak(self, step_peak: int, state_bytes: int) -> int:
        """The run's peak: the engine keeps its cache between rollouts, so the train step runs beside it; while it
        samples, the state (not the batch, which the rollout is making) and its programs' buffers are live."""
        held = self.kv_cache_bytes + self.kept_bytes
        return max(step_peak + held, state_bytes + held + self.buffers_bytes)


@dataclass
class Plan:
    """What `lm-train plan` reports (all memory in bytes per device)."""

    kind: str  # the training planned: "lm-train <command>" (TrainingKind.name)
    devices: str
    device_count: int
    chip: str
    platform: str
    mesh: dict[str, int]
    memory_bytes_per_device: int
    usable_bytes_per_device: int
    usable_why: str
    vocab_size: int
    vocab_from: str
    seq_len: int
    mp: str
    tokens_per_step: int
    parameter_count: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    frozen_bytes: int  # the kind's frozen model beside the state (0: none)
    batch_bytes: int
    batch_fields: list[str]  # what the batch holds per position (lm_train.run.batch's field names)
    estimate: Estimate
    policies: dict[str, Estimate]
    model_flops_per_step: float
    peak_flops_per_device: float
    peak_flops_from: str
    mfu: float
    step_seconds: float
    tokens_per_second: float
    fits: bool
    margin_bytes: int
    compiled_peak_bytes: int | None = None  # XLA's peak for the same step, when compiled: the verdict's figure
    cross_entropy_block_size: int | None = None  # the loss's vocabulary blocks as planned (None: the full logits)
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kind_note: str = ""  # what the heading says of the kind (TrainingKind.plan_note)
    frozen_label: tuple[str, str] = ("frozen model", "")  # the frozen model's line: name and note
    sampling: SamplingMemory | None = None  # what the kind's sampling holds beside the train step (RL)

    @property
    def peak_bytes_per_device(self) -> int:
        """The estimated peak: the train step's, or with sampling beside it, the run's (SamplingMemory.peak)."""
        if self.sampling is None:
            return self.estimate.peak_bytes
        return self.sampling.peak(self.estimate.peak_bytes, self.estimate.argument_bytes - self.batch_bytes)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["peak_bytes_per_device"] = self.peak_bytes_per_device
        out["reference_bytes"] = out.pop("frozen_bytes")  # the key scripts read since plans had one frozen model
        return out
