"""`lm-train doremi`: DoReMi domain weights for a mixture, from a proxy model against a reference; rerun to resume."""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated

import typer

from lm_train.cli.app import (
    CONTEXT,
    ConfigFiles,
    CoordinatorAddress,
    Debug,
    NumProcesses,
    ProcessId,
    app,
    handles_user_errors,
    load_from_args,
    train_processes,
)

Reference = Annotated[
    str | None,
    typer.Option(
        "--reference",
        help="The reference model: a checkpoint or run directory of `lm-train run` on this mixture, same model shape.",
    ),
]


@app.command(context_settings=CONTEXT)
@handles_user_errors
def doremi(
    ctx: typer.Context,
    configs: ConfigFiles,
    reference: Reference = None,
    coordinator_address: CoordinatorAddress = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
    debug: Debug = False,
) -> None:
    """DoReMi: `lm-train doremi MIX.yaml --reference CKPT`; writes <run_dir>/doremi_weights.yaml; rerun to resume."""
    config, files = load_from_args(configs, ctx.args)  # first: a config error costs no training import
    if reference is not None:
        config = dataclasses.replace(config, doremi=dataclasses.replace(config.doremi, reference_model_path=reference))
    from lm_train.doremi.training import DOREMI, check_doremi_config, write_weights_file

    check_doremi_config(config)
    result = train_processes(config, files, coordinator_address, num_processes, process_id, kind=DOREMI)
    import jax

    if result.final_step >= config.trainer.num_train_steps and jax.process_index() == 0:
        path = write_weights_file(config, result.state, result.paths.run_dir)
        print(f"DoReMi's averaged domain weights: {path}", file=sys.stderr, flush=True)
