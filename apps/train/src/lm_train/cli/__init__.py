"""The `lm-train` command line: run, eval, cache, config show, sample, export-hf, plan."""

from lm_train.cli import checkpoint_commands, plan_commands, train_commands
from lm_train.cli.app import app, main

__all__ = ["app", "main"]
