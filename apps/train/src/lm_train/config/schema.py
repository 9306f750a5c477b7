"""The typed configuration of a whole training run; keys follow Levanter's where Levanter has one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lm_models import LmConfig
from lm_train.config.data_config import DataConfig
from lm_train.config.doremi_config import DoremiConfig
from lm_train.config.dpo_config import DpoConfig
from lm_train.config.kron_config import KronConfig  # noqa: F401  (registers kron)
from lm_train.config.lora_config import LoraSection
from lm_train.config.optimizer_config import AdamConfig, OptimizerConfig
from lm_train.config.optimizer_recipes import MuonConfig  # noqa: F401  (registers muon, mars and soap)
from lm_train.config.rl_config import RlConfig
from lm_train.config.trainer_config import TrainerConfig
from lm_train.errors import ConfigError


@dataclass(frozen=True)
class LaunchRecord:
    """Written by `lm-train launch` into the run's config.yaml, so that the run says which code trained it."""

    backend: str = ""
    """The launcher that started the run (ray, ...)."""
    commit: str | None = None
    """The git commit of the shipped checkout; null: lm-train was not run from a git checkout."""
    diff_sha256: str | None = None
    """sha256 of the uncommitted changes that were shipped with the commit (diff and untracked files); null: none."""
    dirty_files: tuple[str, ...] = ()
    """The files whose uncommitted state was shipped, as `git status` names them."""


@dataclass(frozen=True)
class TrainLmConfig:
    """A whole training run."""

    data: DataConfig = field(default_factory=lambda: DataConfig(builtin="python_stdlib"))
    model: LmConfig = field(default_factory=lambda: LmConfig.get_choice_class("gpt2")())
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = field(default_factory=AdamConfig)
    z_loss_weight: float = 0.0
    """Weight of the z-loss, the mean squared log-sum-exp of the output logits, added to the loss; 0: off."""
    initialize_from_hf: bool | str | None = None
    """A local Hugging Face model directory to start from (continued pretraining). Levanter's `true` (its default
    hub checkpoint) is refused at run time: lm-train downloads nothing, so give the directory."""
    use_hf_model_config: bool = False
    """With initialize_from_hf: take the model section from that directory's config.json (Levanter's key)."""
    fcm_prob: float = 0.0
    """Forgetful causal masking (Levanter's key): mask each key position but the first out of attention with
    this probability during training; 0: off."""
    hf_save_path: str | None = None
    """Export to Hugging Face format here (default: <run_dir>/hf) at the end and every hf_save_steps."""
    hf_save_steps: int | None = None
    """Also export to hf_save_path every this many steps; null: only at the end of training."""
    lora: LoraSection | None = None
    """Train low-rank adapters on the `initialize_from_hf` model instead of all its weights (null: off)."""
    peft_save_path: str | None = None
    """With `lora`: write the PEFT adapter here (default: <run_dir>/hf) at the end and every hf_save_steps."""
    merged_hf_save_path: str | None = None
    """With `lora`: also write the merged model (adapters folded into the weights) here, as hf_save_path."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """Direct preference optimization: read by `lm-train dpo` only (docs/dpo.md)."""
    doremi: DoremiConfig = field(default_factory=DoremiConfig)
    """DoReMi domain reweighting of a mixture: read by `lm-train doremi` only (docs/mixtures.md)."""
    rl: RlConfig = field(default_factory=RlConfig)
    """Reinforcement learning from verifiable rewards (GRPO): read by `lm-train rl` only (docs/rl.md)."""
    launch: LaunchRecord | None = None
    """The code a launched run was started with, written by `lm-train launch` (docs/scaling.md); null: not launched."""

    def hf_directory(self) -> str:
        """The Hugging Face directory that initialize_from_hf names, for code that runs only when it is set."""
        source = self.initialize_from_hf
        if not isinstance(source, str) or not source:
            raise ConfigError(
                f"initialize_from_hf is {source!r} where a Hugging Face model directory is needed: set it to the "
                "model's local directory (lm-train downloads nothing from the hub)."
            )
        return source


def section_fields(cls: type) -> list[dataclasses.Field]:
    """The init fields of a config dataclass, for docs and --help."""
    return [f for f in dataclasses.fields(cls) if f.init]
