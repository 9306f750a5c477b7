"""The `dpo` section: what `lm-train dpo` needs beyond a training run (beta, the reference model, the pair format)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lm_train.errors import ConfigError

PAIR_FORMATS = ("preference", "preference_chat")
BAD_INPUT_POLICIES = ("fail", "skip")


@dataclass(frozen=True)
class DpoConfig:
    """Direct preference optimization (read by `lm-train dpo`; other commands ignore it)."""

    beta: float = 0.1
    """Strength of the pull towards the reference: the loss is -log sigmoid(beta * (chosen log-ratio - rejected
    log-ratio)), each log-ratio being the policy's minus the reference's log-probability of the response."""
    reference_model_path: str | None = None
    """The frozen reference model: an lm-train checkpoint (or its run directory) or a Hugging Face model
    directory (one with config.json); empty: the run's initial weights (initialize_from_hf, else the seed's)."""
    format: str = "preference"
    """`preference`: jsonl/parquet records with `prompt`, `chosen` and `rejected` strings; `preference_chat`:
    chat messages (`prompt` or `messages` plus `chosen`/`rejected` turns, or two whole conversations)."""
    chat_template: str | None = None
    """For preference_chat: a jinja template, or the name of one of the tokenizer directory's templates; empty:
    the tokenizer directory's own template."""
    on_bad_input: str = "fail"
    """fail: a bad record stops the cache build, naming its file and line; skip: it is skipped and counted."""

    def __post_init__(self) -> None:
        beta = self.beta
        if isinstance(beta, bool) or not (isinstance(beta, int | float) and math.isfinite(beta) and beta > 0):
            raise ConfigError(f"dpo.beta must be a positive number such as 0.1, got {beta!r}.")
        if self.format not in PAIR_FORMATS:
            formats = ", ".join(PAIR_FORMATS)
            raise ConfigError(f"dpo.format: {self.format!r} is not a pair format; use one of {formats}.")
        if self.on_bad_input not in BAD_INPUT_POLICIES:
            raise ConfigError(f"dpo.on_bad_input: {self.on_bad_input!r} is unknown; use fail or skip.")
        if self.chat_template is not None and self.format != "preference_chat":
            raise ConfigError(
                "dpo.chat_template is read with dpo.format: preference_chat only; remove it or set that format."
            )
