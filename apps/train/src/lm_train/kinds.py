"""The table of training kinds: each kind's command, its help and options, and where its TrainingKind lives.

The CLI generates `lm-train run`, `dpo`, `doremi` and `rl` from this table, and `lm-train plan` finds the kind it plans
here. A kind's module is imported only when the kind is used: `--help` and config errors stay free of jax.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm_train.run.training_kind import TrainingKind


@dataclass(frozen=True)
class KindOption:
    """A command-line option of a kind's command that sets one config key (it wins over files and overrides)."""

    flag: str
    key: str
    """The dotted config key it sets, e.g. doremi.reference_model_path."""
    help: str


@dataclass(frozen=True)
class KindEntry:
    """One row of the table: a kind of training as the CLI and the planner find it."""

    command: str
    help: str
    """The command's help, as `lm-train --help` lists it."""
    location: str
    """module:attribute of its TrainingKind."""
    options: tuple[KindOption, ...] = ()
    epilog: str | None = None
    plan_flag: str | None = None
    """The flag of `lm-train plan` that plans this kind (None: the kind `lm-train plan` plans by default)."""
    plan_help: str = ""

    def load(self) -> TrainingKind:
        """The TrainingKind itself (importing its module)."""
        module, _, name = self.location.partition(":")
        return getattr(importlib.import_module(module), name)


KINDS: tuple[KindEntry, ...] = (
    KindEntry(
        command="run",
        help="Train: `lm-train run CONFIG.yaml [--trainer.num_train_steps 500 ...]`; rerun to resume.",
        location="lm_train.language_modeling:LANGUAGE_MODELING",
        epilog="Config keys, each settable as --key value:\n\n{KEYS}",  # main() fills {KEYS} for --help only
    ),
    KindEntry(
        command="dpo",
        help="DPO: `lm-train dpo CONFIG.yaml [--dpo.beta 0.1 ...]` on (prompt, chosen, rejected) pairs; rerun to "
        "resume.",
        location="lm_train.post.dpo.training:DPO",
        plan_flag="--dpo",
        plan_help="Plan `lm-train dpo`'s step: pairs of sequences and a frozen reference model.",
    ),
    KindEntry(
        command="doremi",
        help="DoReMi: `lm-train doremi MIX.yaml --reference CKPT`; writes <run_dir>/doremi_weights.yaml; rerun to "
        "resume.",
        location="lm_train.post.doremi.training:DOREMI",
        options=(
            KindOption(
                "--reference",
                "doremi.reference_model_path",
                "The reference model: a checkpoint or run directory of `lm-train run` on this mixture, same model "
                "shape.",
            ),
        ),
        plan_flag="--doremi",
        plan_help="Plan `lm-train doremi`'s step: a mixture's domain ids, its weights and a frozen reference model.",
    ),
    KindEntry(
        command="rl",
        help="RL from verifiable rewards (GRPO): `lm-train rl CONFIG.yaml [--rl.group_size 8 ...]` on prompts of "
        "data.train_urls; rerun to resume.",
        location="lm_train.post.rl.training:RL",
        plan_flag="--rl",
        plan_help="Plan `lm-train rl`'s train step: sampled completions and a frozen reference model.",
    ),
)
"""Every kind of training, in the order `lm-train --help` lists their commands."""


def kind_entry(command: str) -> KindEntry:
    """The table's row of a command."""
    for entry in KINDS:
        if entry.command == command:
            return entry
    raise KeyError(f"no training kind {command!r}; the kinds are {[e.command for e in KINDS]}")


def training_kind(command: str = "run") -> TrainingKind:
    """The TrainingKind of a command (default: `lm-train run`'s, language modelling)."""
    return kind_entry(command).load()
