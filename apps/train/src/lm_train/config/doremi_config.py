"""The `doremi` section: what `lm-train doremi` needs beyond a mixture run (the reference, the update's constants)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lm_train.errors import ConfigError


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


@dataclass(frozen=True)
class DoremiConfig:
    """DoReMi domain reweighting (read by `lm-train doremi`; other commands ignore it; docs/mixtures.md)."""

    reference_model_path: str | None = None
    """The frozen reference model: an lm-train checkpoint (or its run directory) of the same model shape and
    vocabulary, trained on the mixture's own weights; `lm-train doremi --reference PATH` sets it."""
    step_size: float = 1.0
    """Step size of the exponentiated gradient ascent: the weights are multiplied by exp(step_size * excess
    loss) each step, then renormalised."""
    smoothing: float = 1e-3
    """Smoothing towards uniform after each update, in [0, 1): weights = (1 - smoothing) * weights +
    smoothing / number of trained domains."""

    def __post_init__(self) -> None:
        step_size = _number(self.step_size)
        if step_size is None or step_size <= 0:
            raise ConfigError(f"doremi.step_size must be a positive number such as 1.0, got {self.step_size!r}.")
        smoothing = _number(self.smoothing)
        if smoothing is None or not 0 <= smoothing < 1:
            raise ConfigError(f"doremi.smoothing must be a number in [0, 1) such as 0.001, got {self.smoothing!r}.")
