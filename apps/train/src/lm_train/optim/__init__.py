"""Optimizers: AdamW and Sophia from config, their schedule and weight-decay mask, and the step's hooks."""

from lm_train.optim.builder import build_optimizer, default_decay, weight_decay_mask
from lm_train.optim.interface import HessianObjective, Optimizer, chain, with_hooks
from lm_train.optim.schedule import learning_rate_schedule

__all__ = [
    "HessianObjective",
    "Optimizer",
    "build_optimizer",
    "chain",
    "default_decay",
    "learning_rate_schedule",
    "weight_decay_mask",
    "with_hooks",
]
