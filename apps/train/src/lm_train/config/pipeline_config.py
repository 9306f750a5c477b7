"""The `trainer.pipeline` section: how microbatches flow through the pipeline stages (trainer.pipeline_axis_size)."""

from __future__ import annotations

from dataclasses import dataclass

from lm_train.errors import ConfigError

PIPELINE_SCHEDULES = ("gpipe",)
"""The schedules lm-train has built; `1f1b` and `interleaved` (virtual_stages > 1) are named in issue 42, not built."""


@dataclass(frozen=True)
class PipelineConfig:
    """Microbatches and schedule of pipeline parallelism; read only when trainer.pipeline_axis_size > 1."""

    microbatches: int | None = None
    """Microbatches that flow through the stages per step (per gradient-accumulation microbatch); null: 2 x stages."""
    schedule: str = "gpipe"
    """Order of the stages' work: `gpipe` (every forward, then every backward, through autodiff)."""
    virtual_stages: int = 1
    """Layer chunks per device for an interleaved schedule; 1: one contiguous chunk of layers per stage."""

    def __post_init__(self) -> None:
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"trainer.pipeline.schedule: {self.schedule!r} is not built; lm-train has "
                f"{', '.join(PIPELINE_SCHEDULES)}. Set trainer.pipeline.schedule to one of them."
            )
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(
                f"trainer.pipeline.microbatches must be at least 1 (null: twice the stages), got {self.microbatches}."
            )
        if self.virtual_stages != 1:
            raise ConfigError(
                f"trainer.pipeline.virtual_stages={self.virtual_stages} needs the interleaved schedule, which is not "
                f"built; lm-train has {', '.join(PIPELINE_SCHEDULES)}. Set trainer.pipeline.virtual_stages to 1."
            )

    def microbatches_for(self, stages: int) -> int:
        """The microbatches per step under `stages` stages: the key, or twice the stages."""
        return self.microbatches if self.microbatches is not None else 2 * stages
