"""Configs of the newer optimizers (Muon, MARS, SOAP), with Levanter's keys; their transforms live in lm_train.optim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lm_train.config.optimizer_config import OptimizerConfig, ScheduleConfig, WeightDecayMask
from lm_train.errors import ConfigError

if TYPE_CHECKING:
    import optax


def _in_unit_interval(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"optimizer.{name} must be in [0, 1), got {value}; e.g. {name}: 0.95.")


def _positive(config: Any, example: str, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ConfigError(f"optimizer.{name} must be positive, got {value}; e.g. {name}: {example}.")


def _check_max_grad_norm(config: Any) -> None:
    # Muon and MARS clip themselves and read 0 as off, as Levanter does; the builder's clip (SOAP) reads only null.
    off = "0 or null" if config.clips_own_gradients else "null"
    value = config.max_grad_norm
    if value is not None and not (value > 0 or (value == 0 and config.clips_own_gradients)):
        raise ConfigError(f"optimizer.max_grad_norm must be positive (or {off}: no clipping), got {value}; e.g. 1.0.")


# -- Muon (lm_train.optim.muon) -----------------------------------------------------------------------------


@OptimizerConfig.register_subclass("muon")
@dataclass(frozen=True)
class MuonConfig(ScheduleConfig, OptimizerConfig):
    """Muon on the Linear weights (momentum orthogonalised by Newton-Schulz), AdamW on every other parameter.

    `learning_rate` is Muon's; `adam_lr` is AdamW's, on the same schedule shape. `max_grad_norm` clips only the
    AdamW parameters' gradients, as in Levanter.
    """

    adam_lr: float = 6e-4
    """Peak learning rate of the AdamW parameters (embeddings, LM head, norms, biases)."""
    momentum: float = 0.95
    """Decay of Muon's momentum buffer B = momentum * B + g, in [0, 1)."""
    nesterov: bool = True
    """Orthogonalise momentum * B + g (Nesterov) rather than B."""
    backend_steps: int = 5
    """Newton-Schulz iterations per step."""
    coefficient_type: str = "quintic"
    """Newton-Schulz coefficients (a, b, c): `quintic` (3.4445, -4.775, 2.0315) or `simple` (1.5, -0.5, 0)."""
    ns_coefficients: tuple[float, float, float] | None = None
    """Explicit Newton-Schulz coefficients [a, b, c], in place of coefficient_type's."""
    muon_epsilon: float = 1e-8
    """Added to the Frobenius norm that scales the momentum before the iteration."""
    use_kimi_scaling: bool = False
    """Scale each orthogonal update by 0.2 * sqrt(max(Out, In)) (Kimi) instead of sqrt(max(1, Out / In))."""
    weight_decay: float = 0.0
    """Decoupled weight decay, on the parameters that weight_decay_modules picks (both Muon and AdamW ones)."""
    beta1: float = 0.9
    """AdamW's decay of the moving average of the gradients, in [0, 1)."""
    beta2: float = 0.95
    """AdamW's decay of the moving average of the squared gradients, in [0, 1)."""
    epsilon: float = 1e-8
    """AdamW's epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the AdamW parameters' gradients to this global norm (the Muon ones are not clipped); 0 or null: off."""

    clips_own_gradients: ClassVar[bool] = True

    def __post_init__(self) -> None:
        ScheduleConfig.__post_init__(self)
        _in_unit_interval(self, "momentum", "beta1", "beta2")
        _positive(self, "6e-4", "adam_lr")
        _positive(self, "1e-8", "muon_epsilon", "epsilon")
        _check_max_grad_norm(self)
        if self.backend_steps < 1:
            raise ConfigError(f"optimizer.backend_steps must be at least 1, got {self.backend_steps}; e.g. 5.")
        if self.ns_coefficients is None and self.coefficient_type not in _NS_COEFFICIENTS:
            raise ConfigError(
                f"optimizer.coefficient_type: unknown {self.coefficient_type!r}; use one of "
                f"{', '.join(_NS_COEFFICIENTS)}, or give optimizer.ns_coefficients: [a, b, c]."
            )

    @property
    def newton_schulz_coefficients(self) -> tuple[float, float, float]:
        """The (a, b, c) of each Newton-Schulz iteration."""
        if self.ns_coefficients is not None:
            return tuple(float(c) for c in self.ns_coefficients)  # type: ignore[return-value]
        return _NS_COEFFICIENTS[self.coefficient_type]

    def update_rule(self, schedule: optax.Schedule, decay_mask: WeightDecayMask) -> Any:
        from lm_train.optim.muon import muon

        ratio = self.adam_lr / self.learning_rate
        return muon(
            schedule,
            lambda step: schedule(step) * ratio,  # the same schedule shape, peaking at adam_lr
            momentum=self.momentum,
            nesterov=self.nesterov,
            steps=self.backend_steps,
            coefficients=self.newton_schulz_coefficients,
            muon_eps=self.muon_epsilon,
            kimi_scaling=self.use_kimi_scaling,
            beta1=self.beta1,
            beta2=self.beta2,
            epsilon=self.epsilon,
            weight_decay=self.weight_decay,
            mask=decay_mask,
            adam_max_grad_norm=self.max_grad_norm,
        )


# -- MARS (lm_train.optim.mars) -----------------------------------------------------------------------------


@OptimizerConfig.register_subclass("mars")
@dataclass(frozen=True)
class MarsConfig(ScheduleConfig, OptimizerConfig):
    """MARS-AdamW: AdamW on the variance-reduced gradient c = g + gamma * beta1 / (1 - beta1) * (g - g_prev).

    `max_grad_norm` clips c (not the raw gradient) by its global norm, as the paper and Levanter do.
    """

    weight_decay: float = 0.1
    """Decoupled weight decay, lr * weight_decay * theta, on the parameters weight_decay_modules picks."""
    beta1: float = 0.95
    """Decay of the moving average of c, in [0, 1)."""
    beta2: float = 0.99
    """Decay of the moving average of c squared, in [0, 1)."""
    gamma: float = 0.025
    """Weight of the gradient-difference correction (0: plain AdamW with the clip on c)."""
    epsilon: float = 1e-8
    """Added to the root of the second moment in the denominator."""
    max_grad_norm: float | None = 1.0
    """Clip the corrected gradient c (not the raw gradient) to this global norm; 0 or null: off."""

    clips_own_gradients: ClassVar[bool] = True

    def __post_init__(self) -> None:
        ScheduleConfig.__post_init__(self)
        _in_unit_interval(self, "beta1", "beta2")
        _positive(self, "1e-8", "epsilon")
        _check_max_grad_norm(self)
        if not self.gamma >= 0:
            raise ConfigError(f"optimizer.gamma must be non-negative, got {self.gamma}; e.g. gamma: 0.025.")

    def update_rule(self, schedule: optax.Schedule, decay_mask: WeightDecayMask) -> Any:
        from lm_train.optim.mars import mars

        return mars(
            schedule,
            b1=self.beta1,
            b2=self.beta2,
            gamma=self.gamma,
            eps=self.epsilon,
            max_grad_norm=self.max_grad_norm,
            weight_decay=self.weight_decay,
            mask=decay_mask,
        )


# -- SOAP (lm_train.optim.soap) -----------------------------------------------------------------------------


@OptimizerConfig.register_subclass("soap")
@dataclass(frozen=True)
class SoapConfig(ScheduleConfig, OptimizerConfig):
    """SOAP: Adam in the eigenbasis of Shampoo's Kronecker factors, refreshed every precondition_frequency steps."""

    weight_decay: float = 0.0
    """Decoupled weight decay, lr * weight_decay * theta, on the parameters weight_decay_modules picks."""
    beta1: float = 0.95
    """Decay of the moving average of the gradients, in [0, 1)."""
    beta2: float = 0.95
    """Decay of the moving average of the squared rotated gradients, in [0, 1)."""
    shampoo_beta: float = 0.95
    """Decay of the moving averages of the Kronecker factors G G^T, in [0, 1); negative: beta2's value."""
    epsilon: float = 1e-8
    """Added to the root of the second moment in the denominator."""
    precondition_frequency: int = 10
    """Recompute the eigenbases of the factors every this many steps."""
    max_precond_dim: int = 10000
    """A dimension (of a block) larger than this gets no factor: Adam's diagonal along it."""
    merge_small_dims: bool = True
    """Merge neighbouring dimensions while their product stays <= target_merged_dim_size."""
    target_merged_dim_size: int = 2048
    """The largest dimension that merging may make."""
    partition_grads_into_blocks: bool = True
    """Cut each dimension that block_size divides and exceeds into blocks, each with its own factors."""
    block_size: int = 256
    """The size of those blocks."""

    def __post_init__(self) -> None:
        ScheduleConfig.__post_init__(self)
        _in_unit_interval(self, "beta1", "beta2")
        if not self.shampoo_beta < 1.0:
            raise ConfigError(f"optimizer.shampoo_beta must be below 1, got {self.shampoo_beta}; e.g. 0.95.")
        _positive(self, "1e-8", "epsilon")
        _check_max_grad_norm(self)
        for name, example in (
            ("precondition_frequency", 10),
            ("max_precond_dim", 10000),
            ("target_merged_dim_size", 2048),
            ("block_size", 256),
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"optimizer.{name} must be at least 1, got {getattr(self, name)}; e.g. {example}.")

    def update_rule(self, schedule: optax.Schedule, decay_mask: WeightDecayMask) -> Any:
        from lm_train.optim.soap import soap

        return soap(
            schedule,
            weight_decay=self.weight_decay,
            mask=decay_mask,
            b1=self.beta1,
            b2=self.beta2,
            shampoo_beta=self.shampoo_beta if self.shampoo_beta >= 0 else self.beta2,
            eps=self.epsilon,
            precondition_frequency=self.precondition_frequency,
            max_precond_dim=self.max_precond_dim,
            merge_small_dims=self.merge_small_dims,
            target_merged_dim_size=self.target_merged_dim_size,
            partition_grads_into_blocks=self.partition_grads_into_blocks,
            block_size=self.block_size,
        )


# Keller Jordan's quintic (modded-nanogpt) and the plain cubic X <- 1.5 X - 0.5 X X^T X, under Levanter's names.
_NS_COEFFICIENTS: dict[str, tuple[float, float, float]] = {
    "quintic": (3.4445, -4.7750, 2.0315),
    "simple": (1.5, -0.5, 0.0),
}
