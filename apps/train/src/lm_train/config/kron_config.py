"""The config of PSGD Kron (`optimizer.type: kron`), with Levanter's keys; its transform is lm_train.optim.kron."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lm_train.config.optimizer_config import OptimizerConfig, ScheduleConfig, WeightDecayMask
from lm_train.config.optimizer_recipes import _check_max_grad_norm, _in_unit_interval, _positive
from lm_train.errors import ConfigError

if TYPE_CHECKING:
    import optax

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
