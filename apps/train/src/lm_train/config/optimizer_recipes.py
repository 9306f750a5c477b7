"""Configs of the newer optimizers (Muon, MARS, SOAP, Kron), with Levanter's keys; transforms in lm_train.optim."""

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


# -- Kron (lm_train.optim.kron) -----------------------------------------------------------------------------

_DTYPES = ("float32", "bfloat16", "float16")
_PRECISIONS = ("float32", "tensorfloat32", "bfloat16")


@OptimizerConfig.register_subclass("kron")
@dataclass(frozen=True)
class KronConfig(ScheduleConfig, OptimizerConfig):
    """PSGD Kron: momentum whitened by Kronecker-factored preconditioners, fitted now and then (Levanter's keys)."""

    beta1: float = 0.9
    """Momentum, in [0, 1) (0: none, no buffer)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, lr * weight_decay * theta, on the parameters weight_decay_modules picks."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient's global norm to this, unless normalize_grads; 0 or null: off."""
    normalize_grads: bool = False
    """Scale each parameter's gradient to unit norm (then no global-norm clipping)."""
    preconditioner_update_probability: float = 0.05
    """The lowest probability p of a factor update, in (0, 1]: an update every 1/p steps once annealed."""
    update_prob_flat_start: int = 500
    """Update the factors every step for this many steps, then anneal p as exp(-0.001 (step - flat_start))."""
    max_size_triangular: int = 25000
    """A dimension larger than this gets a diagonal factor, not a triangular one."""
    min_ndim_triangular: int = 2
    """A parameter with fewer dimensions than this (`layers` not counted) gets diagonal factors only."""
    memory_save_mode: str | None = None
    """null: triangular factors where sizes allow; `one_diag`: the largest dimension diagonal; `all_diag`."""
    preconditioner_lr: float = 0.1
    """Step size of the factors' fit."""
    preconditioner_init_scale: float = 1.0
    """The preconditioner starts as this times the identity."""
    mu_dtype: str | None = None
    """dtype of the momentum (float32, bfloat16, float16); null: the parameters'."""
    precond_dtype: str | None = None
    """dtype of the stored factors; null: float32."""
    precond_update_precision: str | None = "tensorfloat32"
    """Matmul precision of the factors' fit: float32, tensorfloat32 or bfloat16; null: jax's default."""
    precond_grads_precision: str | None = None
    """Matmul precision of preconditioning the momentum, as precond_update_precision."""
    lax_map_scanned_layers: bool = False
    """Loop over a parameter's blocks (its layers) with lax.map in batches, not vmap: less memory."""
    lax_map_batch_size: int = 8
    """Blocks per batch of that lax.map."""
    merge_small_dims: bool = True
    """Merge neighbouring dimensions while their product stays <= target_merged_dim_size."""
    target_merged_dim_size: int = 8192
    """The largest dimension that merging may make."""
    partition_grads_into_blocks: bool = True
    """Cut each triangular dimension that block_size divides and exceeds into blocks, each with its own factors."""
    block_size: int = 256
    """The size of those blocks."""
    params_sharding: dict[str, Any] | None = None
    """Levanter's explicit parameter shardings: not taken (the momentum follows the parameters'); only null."""
    preconditioner_sharding: tuple[str | None, ...] | None = None
    """Levanter's sharding of the factors: not taken (they are replicated); only null."""

    clips_own_gradients: ClassVar[bool] = True

    def __post_init__(self) -> None:
        ScheduleConfig.__post_init__(self)
        _in_unit_interval(self, "beta1")
        _check_max_grad_norm(self)
        if not 0.0 < self.preconditioner_update_probability <= 1.0:
            raise ConfigError(
                "optimizer.preconditioner_update_probability must be in (0, 1], got "
                f"{self.preconditioner_update_probability}; e.g. 0.05 (an update every 20 steps once annealed)."
            )
        _positive(self, "0.1", "preconditioner_lr")
        _positive(self, "1.0", "preconditioner_init_scale")
        for name, example in (
            ("max_size_triangular", 25000),
            ("min_ndim_triangular", 2),
            ("lax_map_batch_size", 8),
            ("target_merged_dim_size", 8192),
            ("block_size", 256),
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"optimizer.{name} must be at least 1, got {getattr(self, name)}; e.g. {example}.")
        if self.update_prob_flat_start < 0:
            raise ConfigError(
                f"optimizer.update_prob_flat_start must be >= 0 (steps), got {self.update_prob_flat_start}; e.g. 500."
            )
        _one_of(self, "memory_save_mode", (None, "one_diag", "all_diag"))
        _one_of(self, "mu_dtype", (None, *_DTYPES))
        _one_of(self, "precond_dtype", (None, *_DTYPES))
        _one_of(self, "precond_update_precision", (None, *_PRECISIONS))
        _one_of(self, "precond_grads_precision", (None, *_PRECISIONS))
        for name, why in (("params_sharding", "the momentum follows the parameters' sharding"),
                          ("preconditioner_sharding", "the factors are replicated")):  # fmt: skip
            if getattr(self, name) is not None:
                raise ConfigError(
                    f"optimizer.{name} is not taken by lm-train's kron ({why}): remove it or set it to null."
                )

    def update_rule(self, schedule: optax.Schedule, decay_mask: WeightDecayMask) -> Any:
        from lm_train.optim.kron import kron, update_probability_schedule

        return kron(
            schedule,
            weight_decay=self.weight_decay,
            mask=decay_mask,
            max_grad_norm=self.max_grad_norm,
            b1=self.beta1,
            normalize_grads=self.normalize_grads,
            update_probability=update_probability_schedule(
                self.preconditioner_update_probability, self.update_prob_flat_start
            ),
            max_size_triangular=self.max_size_triangular,
            min_ndim_triangular=self.min_ndim_triangular,
            memory_save_mode=self.memory_save_mode,
            preconditioner_lr=self.preconditioner_lr,
            preconditioner_init_scale=self.preconditioner_init_scale,
            mu_dtype=self.mu_dtype,
            precond_dtype=self.precond_dtype,
            precond_update_precision=self.precond_update_precision,
            precond_grads_precision=self.precond_grads_precision,
            lax_map_scanned_layers=self.lax_map_scanned_layers,
            lax_map_batch_size=self.lax_map_batch_size,
            merge_small_dims=self.merge_small_dims,
            target_merged_dim_size=self.target_merged_dim_size,
            partition_grads_into_blocks=self.partition_grads_into_blocks,
            block_size=self.block_size,
        )


def _one_of(config: Any, name: str, choices: tuple) -> None:
    value = getattr(config, name)
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"optimizer.{name}: unknown {value!r}; use one of {shown}.")


# Keller Jordan's quintic (modded-nanogpt) and the plain cubic X <- 1.5 X - 0.5 X X^T X, under Levanter's names.
_NS_COEFFICIENTS: dict[str, tuple[float, float, float]] = {
    "quintic": (3.4445, -4.7750, 2.0315),
    "simple": (1.5, -0.5, 0.0),
}
