"""`lm-train dpo`: direct preference optimization on pairs, from a config; rerun to resume."""

from __future__ import annotations

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


@app.command(context_settings=CONTEXT)
@handles_user_errors
def dpo(
    ctx: typer.Context,
    configs: ConfigFiles,
    coordinator_address: CoordinatorAddress = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
    debug: Debug = False,
) -> None:
    """DPO: `lm-train dpo CONFIG.yaml [--dpo.beta 0.1 ...]` on (prompt, chosen, rejected) pairs; rerun to resume."""
    config, files = load_from_args(configs, ctx.args)  # first: a config error costs no training import
    from lm_train.dpo.training import DPO, check_dpo_config

    check_dpo_config(config)
    train_processes(config, files, coordinator_address, num_processes, process_id, kind=DPO)
