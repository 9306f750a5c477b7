"""`optimizer.skip_bad_steps`: skip a step whose gradient norm is an outlier of the recent ones (Levanter's keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_train.errors import ConfigError


@dataclass(frozen=True)
class SkipStepConfig:
    """Skip a step whose gradient norm is non-finite, or above median + sigma_factor * sigma of a rolling window."""

    rolling_interval_length: int = 128
    """Gradient norms of this many recent steps form the window; outliers are judged once it is half full."""
    sigma_factor: float = 6.0
    """Skip when the gradient norm exceeds the window's median by this many sigmas (sigma = 1.4826 * MAD)."""

    def __post_init__(self) -> None:
        if self.rolling_interval_length < 2:
            raise ConfigError(
                "optimizer.skip_bad_steps.rolling_interval_length must be at least 2 (steps in the window), got "
                f"{self.rolling_interval_length}."
            )
        if self.sigma_factor < 0:
            raise ConfigError(f"optimizer.skip_bad_steps.sigma_factor must be >= 0, got {self.sigma_factor}.")


def skip_steps_config(value: Any) -> SkipStepConfig | None:
    """Levanter's shapes of `optimizer.skip_bad_steps`: false (off), true (defaults), N (window length), a mapping."""
    if isinstance(value, SkipStepConfig) or value is None:
        return value
    if value is False:
        return None
    if value is True:
        return SkipStepConfig()
    if isinstance(value, int):
        return SkipStepConfig(rolling_interval_length=value)
    raise ConfigError(
        f"optimizer.skip_bad_steps: {value!r} is not one of false, true, a window length (e.g. 128) or "
        "{rolling_interval_length: 128, sigma_factor: 6.0}."
    )
