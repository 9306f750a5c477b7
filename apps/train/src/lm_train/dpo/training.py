"""`lm-train dpo`: the training kind that the shared loop runs, and the checks of a DPO config."""

from __future__ import annotations

from lm_train.config.optimizer_config import SophiaGConfig, SophiaHConfig
from lm_train.config.schema import TrainLmConfig
from lm_train.dpo.data import preference_inputs, prepare_preference_data
from lm_train.dpo.loss import dpo_objective
from lm_train.dpo.reference import dpo_starting_state
from lm_train.errors import ConfigError
from lm_train.objectives import Objective
from lm_train.preflight import RunSetup
from lm_train.training_kind import TrainingKind


def check_dpo_config(config: TrainLmConfig) -> None:
    """What DPO needs of the rest of the config, checked before anything is started."""
    data = config.data
    if not data.train_urls:
        raise ConfigError(
            "lm-train dpo reads preference pairs from data.train_urls (jsonl or parquet records with prompt, chosen "
            "and rejected); data.builtin, data.id and mixtures (data.configs) are not pair sources."
        )
    if data.validation_urls:
        raise ConfigError(
            "data.validation_urls: lm-train dpo does not evaluate validation pairs yet; remove the key (training "
            "logs dpo/accuracy and dpo/reward_margin on every logged step)."
        )
    if not data.tokenizer:
        raise ConfigError(
            "data.tokenizer is empty: lm-train dpo needs the tokenizer of the model it tunes (a tokenizer.json or a "
            "Hugging Face tokenizer directory)."
        )
    if isinstance(config.optimizer, SophiaGConfig | SophiaHConfig):
        raise ConfigError(
            "optimizer.type: Sophia estimates the curvature of the next-token loss, not of DPO's; use optimizer.type: "
            "adam for lm-train dpo."
        )
    if config.z_loss_weight:
        raise ConfigError("z_loss_weight applies to the next-token loss, not to DPO's; remove it for lm-train dpo.")
    if config.fcm_prob:
        raise ConfigError("fcm_prob (forgetful causal masking) is for the next-token loss, not DPO; remove it.")


def _objective(setup: RunSetup) -> Objective:
    return dpo_objective(setup.config.dpo.beta)


DPO = TrainingKind(
    prepare_data=prepare_preference_data,
    start=dpo_starting_state,
    inputs=preference_inputs,
    objective=_objective,
    sequences_per_example=2,
    flops_scale=4 / 3,  # the policy's forward and backward (6N per token) plus the reference's forward (2N)
)
