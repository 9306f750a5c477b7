"""The `optimizer` section: AdamW and Sophia, selected by `optimizer.type`, their schedule, and bad-step skipping."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from lm_models import config_registry
from lm_train.errors import ConfigError

if TYPE_CHECKING:
    import optax

OptimizerT = TypeVar("OptimizerT", bound=type)
WeightDecayMask = Callable[[Any], Any]
"""Parameters -> a tree of booleans: which parameters get weight decay."""


@config_registry("optimizer", default="adam")
class OptimizerConfig:
    """Base of optimizer configs, selected by `optimizer.type`; each builds its own update rule.

    A new optimizer is one registered config whose `update_rule` returns its transformation: the builder
    (lm_train.optim.builder) adds clipping and names no optimizer. Transformations are imported inside
    `update_rule`, so that reading a config never imports jax or optax.
    """

    clips_own_gradients: ClassVar[bool] = False
    """True when the update rule applies `max_grad_norm` itself (Muon, MARS): the builder then adds no clipping."""

    def update_rule(self, schedule: optax.Schedule, decay_mask: WeightDecayMask) -> Any:
        """The optimizer's transformation (an optax.GradientTransformation or an lm_train.optim Optimizer)."""
        raise ConfigError(
            f"optimizer.type {type(self).__name__} is registered without an update rule: define "
            "update_rule(schedule, decay_mask) on its config class, returning its transformation."
        )

    if TYPE_CHECKING:  # installed at run time by @config_registry above; declared for type checkers

        @classmethod
        def register_subclass(cls, name: str) -> Callable[[OptimizerT], OptimizerT]: ...
        @classmethod
        def get_choice_class(cls, name: str) -> type[OptimizerConfig]: ...
        @classmethod
        def get_known_choices(cls) -> dict[str, type[OptimizerConfig]]: ...
        @classmethod
        def get_choice_name(cls, subcls: type) -> str: ...
        @classmethod
        def default_choice_name(cls) -> str | None: ...
        @classmethod
        def unregister(cls, name: str) -> None: ...


LR_SCHEDULES = ("cosine", "linear", "constant", "inv_sqrt", "inv")


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


@dataclass(frozen=True)
class ScheduleConfig:
    learning_rate: float = 6e-4
    """Peak learning rate, reached at the end of warm-up; must be positive."""
    weight_decay: float = 0.1
    """Decoupled weight decay, lr * weight_decay * theta per step, on the parameters weight_decay_modules picks."""
    min_lr_ratio: float = 0.1
    """The learning rate decays to learning_rate * min_lr_ratio."""
    warmup: float = 0.01
    """Warm-up length: a fraction of the (first) cycle if < 1, else a number of steps."""
    decay: float | None = None
    """Decay length at the end of each cycle, as warmup; the lr is held at its peak between warm-up and decay
    (warmup-stable-decay, WSD). null: decay over the whole cycle after warm-up."""
    lr_schedule: str = "cosine"
    """Shape of the decay: `cosine`, `linear`, `constant`, `inv_sqrt` or `inv` (Levanter's)."""
    rewarmup: float = 0.0
    """Re-warm-up at the start of every cycle after the first, from the lr the last one ended at, as warmup."""
    cycles: int | tuple[int, ...] | None = None
    """Repeat the schedule in this many equal cycles, or end cycles at these steps (e.g. [1000, 3000]);
    null: one cycle. At most one of cycles and cycle_length."""
    cycle_length: float | tuple[int, ...] | None = None
    """Length of each cycle (as warmup), or a list of cycle lengths; null: one cycle."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (null: no clipping)."""
    weight_decay_modules: tuple[str, ...] | None = None
    """Regexes of parameter paths that get weight decay; null: all but norms, biases and embeddings."""
    skip_bad_steps: SkipStepConfig | bool | int = False
    """Skip steps whose gradient norm is non-finite or an outlier: true, a window length, or
    {rolling_interval_length, sigma_factor} (Levanter's keys); false: off."""

    @property
    def skip_steps(self) -> SkipStepConfig | None:
        """optimizer.skip_bad_steps as a config, or None when off."""
        return skip_steps_config(self.skip_bad_steps)

    def __post_init__(self) -> None:
        self.skip_steps  # noqa: B018  (a bad value is refused as the config loads)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"optimizer.lr_schedule: unknown schedule {self.lr_schedule!r}; use one of {', '.join(LR_SCHEDULES)}."
            )
        for key in ("warmup", "decay", "rewarmup", "cycle_length"):
            value = getattr(self, key)
            if isinstance(value, int | float) and value < 0:
                raise ConfigError(f"optimizer.{key} must be a fraction (< 1) or a number of steps, got {value}.")
        if self.cycles is not None and self.cycle_length is not None:
            raise ConfigError("optimizer.cycles and optimizer.cycle_length are both given: keep one (null the other).")
        if isinstance(self.cycles, int) and self.cycles < 1:
            raise ConfigError(f"optimizer.cycles must be at least 1 (or a list of cycle end steps), got {self.cycles}.")
        if self.learning_rate <= 0:
            raise ConfigError("optimizer.learning_rate must be positive.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("optimizer.min_lr_ratio must be in [0, 1].")
        if self.lr_schedule == "inv" and self.min_lr_ratio == 0:
            raise ConfigError("optimizer.lr_schedule inv decays towards min_lr_ratio: give a positive min_lr_ratio.")


@OptimizerConfig.register_subclass("adam")
@dataclass(frozen=True)
class AdamConfig(ScheduleConfig, OptimizerConfig):
    """AdamW with warm-up then cosine/linear decay."""

    beta1: float = 0.9
    """Decay of Adam's moving average of the gradients, in [0, 1)."""
    beta2: float = 0.95
    """Decay of Adam's moving average of the squared gradients, in [0, 1)."""
    epsilon: float = 1e-8
    """Added to the root of the second moment in Adam's denominator, for stability."""

    def update_rule(self, schedule: optax.Schedule, decay_mask: WeightDecayMask) -> Any:
        import optax

        return optax.adamw(
            schedule, b1=self.beta1, b2=self.beta2, eps=self.epsilon, weight_decay=self.weight_decay, mask=decay_mask
        )


# The paper's recommendations (Section 3 and Appendix): b1 = 0.96, b2 = 0.99, eps = 1e-12, k = 10;
# gamma = 0.01 for Sophia-H and 0.05 for Sophia-G (the same values as Levanter's GAMMA_SOPHIA_H/G).
GAMMA_SOPHIA_H = 0.01
GAMMA_SOPHIA_G = 0.05


# -- Sophia (its transformation is in lm_train.optim.sophia) ---------------------------------------------


@dataclass(frozen=True)
class _SophiaFields:
    beta1: float = 0.96
    """EMA decay of the gradients (paper: 0.96)."""
    beta2: float = 0.99
    """EMA decay of the Hessian-diagonal estimates, applied at each refresh (paper: 0.99)."""
    gamma: float = GAMMA_SOPHIA_H
    """Scale of the Hessian in the denominator max(gamma * h, epsilon): larger means smaller, more clipped steps."""
    epsilon: float = 1e-12
    """Floor of the denominator (paper: 1e-12)."""
    update_hessian_every: int = 10
    """Refresh the Hessian estimate every this many steps, k (paper: 10)."""
    weight_decay: float = 0.2
    """Decoupled weight decay, lr * weight_decay * theta (the official GPT-2 Sophia configs use 0.2)."""

    estimator: ClassVar[str]

    def update_rule(self, schedule: optax.Schedule, decay_mask: WeightDecayMask) -> Any:
        from lm_train.optim.sophia import sophia

        return sophia(
            schedule,
            b1=self.beta1,
            b2=self.beta2,
            gamma=self.gamma,
            eps=self.epsilon,
            weight_decay=self.weight_decay,
            mask=decay_mask,
            update_hessian_every=self.update_hessian_every,
            estimator=self.estimator,  # type: ignore[arg-type]
        )


@OptimizerConfig.register_subclass("sophia-h")
@dataclass(frozen=True)
class SophiaHConfig(_SophiaFields, ScheduleConfig, OptimizerConfig):
    """Sophia-H: Sophia with Hutchinson's estimator of the Hessian diagonal (Hessian-vector products)."""

    estimator: ClassVar[str] = "hutchinson"

    def __post_init__(self) -> None:
        ScheduleConfig.__post_init__(self)
        _check_sophia(self)


@OptimizerConfig.register_subclass("sophia-g")
@dataclass(frozen=True)
class SophiaGConfig(_SophiaFields, ScheduleConfig, OptimizerConfig):
    """Sophia-G: Sophia with the Gauss-Newton-Bartlett estimator (labels sampled from the model's softmax)."""

    gamma: float = GAMMA_SOPHIA_G
    """Scale of the Hessian in the denominator max(gamma * h, epsilon): larger means smaller, more clipped steps."""

    estimator: ClassVar[str] = "gauss_newton_bartlett"

    def __post_init__(self) -> None:
        ScheduleConfig.__post_init__(self)
        _check_sophia(self)


SophiaConfig = SophiaHConfig | SophiaGConfig


def _check_sophia(config: SophiaHConfig | SophiaGConfig) -> None:
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ConfigError(f"optimizer.{name} must be in [0, 1), got {getattr(config, name)}.")
    if config.gamma <= 0 or config.epsilon <= 0:
        raise ConfigError("optimizer.gamma and optimizer.epsilon must be positive (e.g. gamma: 0.05, epsilon: 1e-12).")
    if config.update_hessian_every < 1:
        raise ConfigError(f"optimizer.update_hessian_every must be at least 1, got {config.update_hessian_every}.")
