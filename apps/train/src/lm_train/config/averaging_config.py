"""The `trainer.model_averaging` section: an average of the weights over the steps (Levanter's `type: ema`)."""

from __future__ import annotations

from dataclasses import dataclass

from lm_train.errors import ConfigError

AVERAGING_TYPES = ("ema",)


@dataclass(frozen=True)
class ModelAveragingConfig:
    """An exponential moving average of the trainable weights, updated inside every step and checkpointed."""

    type: str = "ema"
    """The kind of average: `ema` (Levanter's `ema_decay_sqrt` is not built here)."""
    beta: float = 0.999
    """Decay of the average per step: average = beta * average + (1 - beta) * weights (Levanter's key)."""
    eval_ema: bool = True
    """Evaluate the averaged weights too, logged as `eval/ema/loss` beside the current weights' `eval/loss`."""
    export_ema: bool = True
    """Hugging Face exports made during training (hf_save_path) hold the averaged weights; false: the current."""

    def __post_init__(self) -> None:
        if self.type not in AVERAGING_TYPES:
            raise ConfigError(
                f"trainer.model_averaging.type: unknown type {self.type!r}; lm-train has {', '.join(AVERAGING_TYPES)} "
                "(an exponential moving average of the weights, with trainer.model_averaging.beta)."
            )
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(
                f"trainer.model_averaging.beta must be in [0, 1), got {self.beta}: e.g. 0.999 averages over about "
                "the last 1000 steps."
            )

    def decay(self) -> float:
        """The weight of the old average in each step's update (the new weights get 1 - decay)."""
        return self.beta
