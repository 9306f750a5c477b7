"""`lm-train plan`: memory per device, the verdict and the speed of a config, for any hardware, in seconds."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from lm_train.cli.app import CONTEXT, ConfigFiles, Debug, app, handles_user_errors, load_from_args

Devices = Annotated[
    str | None,
    typer.Option(
        "--devices",
        help="Hardware to plan for: cpu:8, 8xH100, 64xH200, 4x8xA100 (hosts x GPUs), v4-256, v5e-64 (a TPU "
        "slice). Default: the devices present.",
    ),
]


@app.command(context_settings=CONTEXT)
@handles_user_errors
def plan(
    ctx: typer.Context,
    configs: ConfigFiles,
    devices: Devices = None,
    compile: Annotated[
        bool, typer.Option("--compile", help="Also compile the step on the devices present; print XLA's peak.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
    mfu: Annotated[
        float | None, typer.Option(help="Model FLOPs utilisation for the predicted speed (default 0.45; 0.6 on CPU).")
    ] = None,
    vocab_size: Annotated[
        int | None, typer.Option(help="Vocabulary size, when the config's tokenizer is not on this machine.")
    ] = None,
    dpo: Annotated[
        bool,
        typer.Option("--dpo", help="Plan `lm-train dpo`'s step: pairs of sequences and a frozen reference model."),
    ] = False,
    debug: Debug = False,
) -> None:
    """Per-device memory (state, activations per remat policy, logits), peak, verdict and speed, without a
    compile: `lm-train plan CONFIG.yaml --devices 8xH100`."""
    config, files = load_from_args(configs, ctx.args)
    from lm_train.planning.setup import plan_for

    plan_, xla = plan_for(config, devices, vocab_size=vocab_size, mfu=mfu, compile_check=compile, dpo=dpo)
    if as_json:
        from lm_train.planning.report import plan_json

        typer.echo(json.dumps(plan_json(plan_, xla)))
    else:
        from lm_train.planning.report import render_text

        typer.echo(render_text(plan_, " ".join(str(f) for f in files), xla))
