"""The `rl` section: what `lm-train rl` needs beyond a training run (group size, sampling, rewards, the loss)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lm_train.errors import ConfigError

RL_LOSSES = ("grpo", "dr_grpo", "gspo")
REWARD_ERROR_POLICIES = ("raise", "zero")
BAD_PROMPT_POLICIES = ("error", "skip")


@dataclass(frozen=True)
class RewardSpec:
    """One reward: a function named by import path, called as fn(record, completion, **kwargs) -> float."""

    fn: str
    """`module.path:function`, e.g. lm_train.post.rl.rewards:exact_answer (the built-ins are listed in docs/rl.md)."""
    weight: float = 1.0
    """Its weight in the total reward that the advantages are computed from."""
    name: str | None = None
    """Its name in the logs (rl/reward/<name>/mean); empty: the function's name."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function on every call (e.g. marker, tolerance)."""

    @property
    def label(self) -> str:
        return self.name or self.fn.rpartition(":")[2]


@dataclass(frozen=True)
class RlConfig:
    """Reinforcement learning from verifiable rewards (read by `lm-train rl`; other commands ignore it)."""

    group_size: int = 8
    """G: completions sampled per prompt; each one's advantage is its reward relative to its group's."""
    prompts_per_step: int = 8
    """B: prompts per rollout; trainer.train_batch_size must be B * G (or divide it, with rl.updates_per_batch)."""
    updates_per_batch: int = 1
    """Optimizer steps taken on each batch of sampled completions (TRL's steps_per_generation x num_iterations):
    the B * G completions are split into minibatches of trainer.train_batch_size and gone through in order, as often
    as it takes; the old policy of every update is the sampling one, so from the second update on the ratio moves and
    clipping acts. trainer.num_train_steps counts optimizer steps."""
    max_new_tokens: int = 32
    """The most tokens sampled per completion (a prompt plus these must fit in model.seq_len)."""
    temperature: float = 1.0
    """Sampling temperature of the completions (log-probs are those of the model itself, at temperature 1)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference model (0: none; the KL is logged either way)."""
    clip_epsilon: float = 0.2
    """The importance ratio is clipped to [1 - clip_epsilon, 1 + clip_epsilon] in the policy-gradient objective."""
    loss: str = "grpo"
    """grpo: token ratios, each completion's tokens averaged; dr_grpo: token ratios summed over a constant
    (B * G * max_new_tokens), advantages not divided by the group's spread; gspo: one ratio per completion."""
    rewards: tuple[RewardSpec, ...] = ()
    """The rewards, summed with their weights (at least one)."""
    on_reward_error: str = "raise"
    """raise: a reward that raises stops the run, naming the function and the record; zero: it scores 0."""
    on_bad_prompt: str = "error"
    """error: a prompt record without a prompt that tokenizes, or without a field a reward reads, stops the run before
    sampling, naming its file and line; skip: such records are left out, counted and logged (the first few named)."""
    prompt_field: str = "prompt"
    """The field of each record that holds the prompt: text, or chat messages (rendered with the chat template)."""
    reference_model_path: str | None = None
    """The frozen reference model (lm-train checkpoint or Hugging Face directory); empty: the run's initial
    weights (initialize_from_hf, else the seed's)."""

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_new_tokens", "updates_per_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"rl.{name} must be a positive integer, got {value!r}.")
        if self.group_size < 2:
            raise ConfigError(
                f"rl.group_size is {self.group_size}: a group needs at least 2 completions, since each one's advantage "
                "is its reward minus its group's mean; set rl.group_size to 2 or more (8 is usual)."
            )
        _number("temperature", self.temperature, low=0.0, high=2.0, open_low=True)
        _number("kl_coef", self.kl_coef, low=0.0)
        _number("clip_epsilon", self.clip_epsilon, low=0.0, high=1.0, open_low=True)
        if self.loss not in RL_LOSSES:
            raise ConfigError(f"rl.loss: {self.loss!r} is unknown; use one of {', '.join(RL_LOSSES)}.")
        if self.on_reward_error not in REWARD_ERROR_POLICIES:
            raise ConfigError(f"rl.on_reward_error: {self.on_reward_error!r} is unknown; use raise or zero.")
        if self.on_bad_prompt not in BAD_PROMPT_POLICIES:
            raise ConfigError(f"rl.on_bad_prompt: {self.on_bad_prompt!r} is unknown; use error or skip.")
        for i, reward in enumerate(self.rewards):
            if not isinstance(reward.fn, str) or ":" not in reward.fn:
                raise ConfigError(
                    f"rl.rewards[{i}].fn: {reward.fn!r} is not an import path; write it as module.path:function, "
                    "e.g. lm_train.post.rl.rewards:exact_answer."
                )
            _number(f"rewards[{i}].weight", reward.weight)
        labels = [r.label for r in self.rewards]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"rl.rewards: two rewards log under the same name ({labels}); give each a `name`.")


def _number(name: str, value: Any, low: float | None = None, high: float | None = None, open_low: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (low is None or value > low or (value == low and not open_low)) and (high is None or value <= high)
    if not ok:
        bounds = (
            f" in {'(' if open_low else '['}{low}, {high if high is not None else 'inf'}]" if low is not None else ""
        )
        raise ConfigError(f"rl.{name} must be a finite number{bounds}, got {value!r}.")
