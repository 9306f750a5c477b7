"""The typed configuration of a training run; keys follow Levanter's where Levanter has one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

from lm_models import LmConfig, config_registry
from lm_train.errors import ConfigError

# -- data ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from, how it is tokenized, and where its cache lives."""

    train_urls: tuple[str, ...] = ()
    """Paths or fsspec URLs (globs and {1..N} ranges) of training documents."""
    validation_urls: tuple[str, ...] = ()
    """Paths or URLs of validation documents; empty with `builtin` means a held-out split of it."""
    id: str | None = None
    """A Hugging Face dataset id or local dataset path (needs the shard-cache `hf` extra)."""
    builtin: str | None = None
    """`python_stdlib`: the Python standard library's own source files, present on every machine."""
    validation_fraction: float = 0.02
    """With `builtin`, the share of files held out for validation (chosen by a hash of each path)."""
    text_key: str = "text"
    """The field of jsonl/parquet records that holds the text."""
    tokenizer: str | None = None
    """A tokenizer.json file or Hugging Face tokenizer directory; empty: train a byte-level BPE on first use."""
    vocab_size: int = 4096
    """Vocabulary size of the byte-level BPE trained when `tokenizer` is empty."""
    cache_dir: str = "cache"
    """Directory or fsspec URL of the tokenized cache (and of a trained tokenizer)."""
    shuffle: bool | int = True
    """true: a seeded full permutation of all examples (waits for the cache); N: shuffle within eras of N
    examples (training starts while the cache is still being built); false: cache order."""
    enforce_eos: bool = True
    """Append exactly one end-of-sequence token to every document."""
    chunk_size: int = 256
    """Documents per cache chunk."""
    num_workers: int | None = None
    """Ray workers for the cache build (default: the CPUs Ray sees)."""

    def __post_init__(self) -> None:
        sources = [bool(self.train_urls), self.id is not None, self.builtin is not None]
        if sum(sources) != 1:
            raise ConfigError(
                "data: give exactly one source of training text: `data.train_urls`, `data.id` or "
                f"`data.builtin: python_stdlib` (got train_urls={list(self.train_urls)}, id={self.id!r}, "
                f"builtin={self.builtin!r})."
            )
        if self.builtin is not None and self.builtin != "python_stdlib":
            raise ConfigError(f"data.builtin: unknown corpus {self.builtin!r}; the built-in corpus is `python_stdlib`.")
        if not 0.0 < self.validation_fraction < 0.5:
            raise ConfigError("data.validation_fraction must be between 0 and 0.5, e.g. 0.02.")
        if self.vocab_size < 260:
            raise ConfigError("data.vocab_size must be at least 260 (256 bytes plus special tokens).")


# -- optimizer ----------------------------------------------------------------------------------------------


@config_registry("optimizer", default="adam")
class OptimizerConfig:
    """Base of optimizer configs, selected by `optimizer.type`."""


@dataclass(frozen=True)
class _ScheduleMixin:
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    """The learning rate decays to learning_rate * min_lr_ratio."""
    warmup: float = 0.01
    """Warm-up length: a fraction of num_train_steps if < 1, else a number of steps."""
    decay: float | None = None
    """Decay length, as warmup; None: until the end of training."""
    lr_schedule: str = "cosine"
    """`cosine`, `linear` or `constant` after warm-up."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping)."""
    weight_decay_modules: tuple[str, ...] | None = None
    """Regexes of parameter paths that get weight decay; None: all but norms, biases and embeddings."""

    def __post_init__(self) -> None:
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(
                f"optimizer.lr_schedule: unknown schedule {self.lr_schedule!r}; use cosine, linear or constant."
            )
        if self.learning_rate <= 0:
            raise ConfigError("optimizer.learning_rate must be positive.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("optimizer.min_lr_ratio must be in [0, 1].")


@OptimizerConfig.register_subclass("adam")
@dataclass(frozen=True)
class AdamConfig(_ScheduleMixin, OptimizerConfig):
    """AdamW with warm-up then cosine/linear decay."""

    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-8


# The paper's recommendations (Section 3 and Appendix): b1 = 0.96, b2 = 0.99, eps = 1e-12, k = 10;
# gamma = 0.01 for Sophia-H and 0.05 for Sophia-G (the same values as Levanter's GAMMA_SOPHIA_H/G).
GAMMA_SOPHIA_H = 0.01
GAMMA_SOPHIA_G = 0.05


# -- Sophia (its optax transformation is in lm_train.sophia) ------------------------------------------------


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


@OptimizerConfig.register_subclass("sophia-h")
@dataclass(frozen=True)
class SophiaHConfig(_SophiaFields, _ScheduleMixin, OptimizerConfig):
    """Sophia-H: Sophia with Hutchinson's estimator of the Hessian diagonal (Hessian-vector products)."""

    estimator: ClassVar[str] = "hutchinson"

    def __post_init__(self) -> None:
        _ScheduleMixin.__post_init__(self)
        _check_sophia(self)


@OptimizerConfig.register_subclass("sophia-g")
@dataclass(frozen=True)
class SophiaGConfig(_SophiaFields, _ScheduleMixin, OptimizerConfig):
    """Sophia-G: Sophia with the Gauss-Newton-Bartlett estimator (labels sampled from the model's softmax)."""

    gamma: float = GAMMA_SOPHIA_G
    """Scale of the Hessian in the denominator max(gamma * h, epsilon): larger means smaller, more clipped steps."""

    estimator: ClassVar[str] = "gauss_newton_bartlett"

    def __post_init__(self) -> None:
        _ScheduleMixin.__post_init__(self)
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


# -- trainer ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeepPolicy:
    """Keep a permanent checkpoint every `every` steps (until step `until`, if given)."""

    every: int
    until: int | None = None


@dataclass(frozen=True)
class CheckpointerConfig:
    """When checkpoints are written and which are kept."""

    base_path: str | None = None
    """Where checkpoints go; default: <run_dir>/checkpoints."""
    save_interval: timedelta = timedelta(minutes=15)
    """Write a temporary checkpoint this often (e.g. 10m); it is deleted once a newer one is complete."""
    keep: tuple[KeepPolicy, ...] = (KeepPolicy(every=10000),)
    """Permanent checkpoints: a list of {every: N, until: M}."""


@dataclass(frozen=True)
class TrainerConfig:
    """The loop: steps, batch, precision, mesh, evaluation, checkpoints, trackers."""

    seed: int = 0
    num_train_steps: int = 1000
    train_batch_size: int = 32
    per_device_parallelism: int = -1
    """Examples per device per microbatch; -1: the whole batch at once (no gradient accumulation)."""
    per_device_eval_parallelism: int = -1
    mp: str = "f32"
    """jmp precision policy, e.g. `p=f32,c=bfloat16`, `bfloat16` or `f32`."""
    steps_per_eval: int = 1000
    max_eval_batches: int | None = None
    log_every: int = 10
    """Log training metrics every this many steps."""
    model_axis_size: int = 1
    """Tensor-parallel degree (the `model` mesh axis)."""
    fsdp_axis: str | None = "embed"
    """Parameter axis sharded over the data axis (FSDP); None: replicate parameters."""
    tensor_parallel_axes: tuple[str, ...] = ("mlp", "heads", "kv_heads")
    """Axes sharded over the `model` mesh axis (tensor parallelism) when model_axis_size > 1."""
    batch_axis: str = "batch"
    mesh: dict[str, int] | None = None
    """Explicit mesh sizes, e.g. {replica: 2, data: -1, model: 2} (-1: the rest); overrides model_axis_size."""
    axis_resources: dict[str, Any] | None = None
    """Compute mapping overrides: logical axis -> mesh axis (or list of them, or null)."""
    parameter_axis_resources: dict[str, Any] | None = None
    """Parameter mapping overrides: logical axis -> mesh axis (or list of them, or null)."""
    id: str | None = None
    """Run name; default: derived from the config file name."""
    run_dir: str | None = None
    """Directory of the run; default: runs/<id>."""
    load_checkpoint: bool | None = None
    """True: resume, error if there is no checkpoint; False: start fresh; None: resume if one exists."""
    load_checkpoint_path: str | None = None
    checkpointer: CheckpointerConfig = field(default_factory=CheckpointerConfig)
    tracker: Any = None
    """A tracker config ({type: wandb|tensorboard|console|noop|jsonl, ...}) or a list of them."""

    def __post_init__(self) -> None:
        for key in ("num_train_steps", "train_batch_size", "steps_per_eval", "log_every", "model_axis_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key} must be at least 1, got {getattr(self, key)}.")


# -- the run ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainLmConfig:
    """A whole training run."""

    data: DataConfig = field(default_factory=lambda: DataConfig(builtin="python_stdlib"))
    model: LmConfig = field(default_factory=lambda: LmConfig.get_choice_class("gpt2")())
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    z_loss_weight: float = 0.0
    initialize_from_hf: str | None = None
    """A local Hugging Face model directory to start from (continued pretraining)."""
    hf_save_path: str | None = None
    """Export to Hugging Face format here (default: <run_dir>/hf) at the end and every hf_save_steps."""
    hf_save_steps: int | None = None


def section_fields(cls: type) -> list[dataclasses.Field]:
    """The init fields of a config dataclass, for docs and --help."""
    return [f for f in dataclasses.fields(cls) if f.init]
