"""`lm-train dpo`: the training kind that the shared loop runs, and the checks of a DPO config."""

from __future__ import annotations

import numpy as np

from lm_train.config.optimizer_config import SophiaGConfig, SophiaHConfig
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import ConfigError
from lm_train.post.dpo.data import PAIR_FIELDS, preference_inputs, prepare_preference_data
from lm_train.post.dpo.loss import dpo_objective
from lm_train.post.dpo.reference import reference_model
from lm_train.run.batch import BatchField
from lm_train.run.objectives import Objective
from lm_train.run.training_kind import TrainingKind


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


def _objective(config: TrainLmConfig) -> Objective:
    return dpo_objective(config.dpo.beta)


def _pair_fields(config: TrainLmConfig) -> tuple[str, ...]:
    return PAIR_FIELDS


DPO = TrainingKind(
    command="dpo",
    prepare_data=prepare_preference_data,
    inputs=preference_inputs,
    objective=_objective,
    batch_fields=_pair_fields,
    # A pair's second sequence; input_ids and loss_mask hold the chosen one.
    extra_fields={"rejected_input_ids": BatchField(np.int32), "rejected_loss_mask": BatchField(np.bool_)},
    check_config=check_dpo_config,
    frozen_model=reference_model,
    sequences_per_example=2,
    flops_scale=4 / 3,  # the policy's forward and backward (6N per token) plus the reference's forward (2N)
    plan_note="pairs, and a frozen reference model",
    frozen_label=("reference model", "(DPO's, frozen, compute dtype)"),
)
