"""Rewards: functions fn(record, completion, **kwargs) -> float named by import path, the built-in ones, and the
scoring of a step's completions with the rewards' weights."""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm_train.config.rl_config import RewardSpec
from lm_train.errors import ConfigError, DataError


def _after_marker(completion: str, marker: str) -> str | None:
    # The last marker counts: a model that restates the question before answering is scored on its answer.
    if marker not in completion:
        return None
    return completion.rsplit(marker, 1)[1]


def exact_answer(record: Mapping[str, Any], completion: str, marker: str = "####", field: str = "answer") -> float:
    """1.0 when the text after the last `marker` equals record[field], whitespace ignored; else 0.0."""
    answer = _after_marker(completion, marker)
    if answer is None:
        return 0.0
    return float("".join(answer.split()) == "".join(str(record[field]).split()))


exact_answer.fields = ("answer",)  # type: ignore[attr-defined]  # the record fields it reads (checked up front)


def number_within(
    record: Mapping[str, Any], completion: str, marker: str = "####", field: str = "answer", tolerance: float = 0.0
) -> float:
    """1.0 when the number after the last `marker` is within `tolerance` of record[field]; else 0.0."""
    answer = _after_marker(completion, marker)
    if answer is None:
        return 0.0
    try:
        value = float("".join(answer.split()).replace(",", ""))
    except ValueError:
        return 0.0
    return float(math.isfinite(value) and abs(value - float(record[field])) <= tolerance)


number_within.fields = ("answer",)  # type: ignore[attr-defined]


def format_check(record: Mapping[str, Any], completion: str, pattern: str = r".*####\s*\S+\s*") -> float:
    """1.0 when the whole completion (stripped) matches the regular expression `pattern`; else 0.0."""
    return float(re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) is not None)


format_check.fields = ()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Reward:
    """A loaded reward: its label, weight, function and keyword arguments."""

    label: str
    weight: float
    fn: Callable[..., Any]
    kwargs: Mapping[str, Any]
    path: str

    def fields(self) -> tuple[str, ...]:
        """The record fields it reads: its `fields` attribute, and a `field` keyword argument where given."""
        declared = tuple(getattr(self.fn, "fields", ()))
        field_arg = self.kwargs.get("field")
        if field_arg is not None:  # the keyword renames the field the built-ins read
            declared = (*(f for f in declared if f != "answer"), str(field_arg))
        return declared


def load_rewards(specs: Sequence[RewardSpec]) -> list[Reward]:
    """Each reward's function imported from its path, or a ConfigError naming rl.rewards[i].fn and the fix."""
    if not specs:
        raise ConfigError(
            "rl.rewards is empty: give at least one reward, e.g. rl.rewards: [{fn: "
            '"lm_train.post.rl.rewards:exact_answer", weight: 1.0}].'
        )
    rewards = []
    for i, spec in enumerate(specs):
        module_name, _, attribute = spec.fn.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # any import failure is the user's path or module: say which
            raise ConfigError(
                f"rl.rewards[{i}].fn: cannot import module {module_name!r} ({type(error).__name__}: {error}). Check "
                "the path, and that the module is importable (installed, or on PYTHONPATH)."
            ) from None
        fn = getattr(module, attribute, None)
        if not callable(fn):
            raise ConfigError(
                f"rl.rewards[{i}].fn: module {module_name!r} has no function {attribute!r}; give "
                "module.path:function of a function fn(record, completion) -> float."
            )
        rewards.append(Reward(spec.label, float(spec.weight), fn, dict(spec.kwargs), spec.fn))
    return rewards


def _record_text(record: Mapping[str, Any]) -> str:
    text = json.dumps(dict(record), ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:197] + "..."


class RewardError(DataError):
    """A reward that raised or returned something other than a number, naming the function and the record."""


def score(reward: Reward, record: Mapping[str, Any], where: str, completion: str, on_error: str) -> float:
    """One reward of one completion; a RewardError (or 0.0 where on_error is zero, for a raising reward)."""
    try:
        value = reward.fn(record, completion, **reward.kwargs)
    except Exception as error:
        if on_error == "zero":
            return 0.0
        raise RewardError(
            f"rl.rewards: {reward.path} raised {type(error).__name__}: {error} on {where} {_record_text(record)} with "
            f"completion {completion[:80]!r}. Fix the reward or the record, or set rl.on_reward_error: zero to "
            "score such completions 0."
        ) from None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise RewardError(
            f"rl.rewards: {reward.path} returned {value!r} ({type(value).__name__}), not a number, on {where} "
            f"{_record_text(record)}. A reward must return a float."
        )
    if not math.isfinite(float(value)):
        raise RewardError(f"rl.rewards: {reward.path} returned {value} on {where} {_record_text(record)}: not finite.")
    return float(value)


def score_all(
    rewards: Sequence[Reward],
    records: Sequence[tuple[Mapping[str, Any], str]],
    completions: Sequence[str],
    on_error: str,
) -> np.ndarray:
    """Every reward of every completion, (rewards, completions); `records` holds each completion's (record, where)."""
    out = np.zeros((len(rewards), len(completions)), np.float64)
    for j, ((record, where), completion) in enumerate(zip(records, completions, strict=True)):
        for i, reward in enumerate(rewards):
            out[i, j] = score(reward, record, where, completion, on_error)
    return out
