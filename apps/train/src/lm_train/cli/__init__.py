"""The `lm-train` command line: run, dpo, doremi, eval, cache, config show, sample, serve, export-hf, plan, plot, viz,
harness, launch ray, launch slurm, launch tpu."""

from lm_train.cli import (
    checkpoint_commands,
    kind_commands,
    launch_commands,
    plan_commands,
    serve_commands,
    train_commands,
    watch_commands,
)
from lm_train.cli.app import app, main

__all__ = ["app", "main"]
