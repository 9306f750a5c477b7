"""`lm-train plan`: memory per device, the verdict and the speed of a config, for any hardware, in seconds."""

from __future__ import annotations

import inspect
import json
from typing import Annotated, Any

import typer

from lm_train.cli.app import CONTEXT, ConfigFiles, Debug, app, handles_user_errors, load_from_args
from lm_train.errors import UserError
from lm_train.kinds import KINDS, KindEntry, kind_entry

Devices = Annotated[
    str | None,
    typer.Option(
        "--devices",
        help="Hardware to plan for: cpu:8, 8xH100, 64xH200, 4x8xA100 (hosts x GPUs), v4-256, v5e-64 (a TPU "
        "slice). Default: the devices present.",
    ),
]


def _flagged() -> list[KindEntry]:
    return [entry for entry in KINDS if entry.plan_flag]


def _planned_kind(flags: dict[str, bool]) -> KindEntry:
    """The kind a plan is for: the one whose flag is given, else `lm-train run`'s."""
    chosen = [entry for entry in _flagged() if flags.get(entry.command)]
    if len(chosen) > 1:
        given = " and ".join(str(entry.plan_flag) for entry in chosen)
        raise UserError(
            f"{given}: a plan is for one kind of training; give one of these flags, or none for lm-train run."
        )
    return chosen[0] if chosen else kind_entry("run")


def _with_kind_flags(fn: Any) -> Any:
    """`fn` with one boolean option per kind in the table that has a plan flag (--dpo, --doremi), before --debug."""
    signature = inspect.signature(fn, eval_str=True)
    fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    flags = [
        inspect.Parameter(
            entry.command,
            inspect.Parameter.KEYWORD_ONLY,
            default=False,
            annotation=Annotated[bool, typer.Option(entry.plan_flag, help=entry.plan_help)],
        )
        for entry in _flagged()
    ]
    parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.default is not p.empty else p for p in fixed]
    debug = next(i for i, p in enumerate(parameters) if p.name == "debug")
    fn.__signature__ = signature.replace(parameters=[*parameters[:debug], *flags, *parameters[debug:]])
    fn.__annotations__ = {p.name: p.annotation for p in fn.__signature__.parameters.values()}
    return fn


@app.command(context_settings=CONTEXT)
@handles_user_errors
@_with_kind_flags
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
    debug: Debug = False,
    **kind_flags: bool,
) -> None:
    """Per-device memory (state, activations per remat policy, logits), peak, verdict and speed, without a
    compile: `lm-train plan CONFIG.yaml --devices 8xH100`."""
    config, files = load_from_args(configs, ctx.args)
    entry = _planned_kind(kind_flags)
    from lm_train.planning.setup import plan_for

    kind = entry.load()
    plan_, xla = plan_for(config, devices, vocab_size=vocab_size, mfu=mfu, compile_check=compile, kind=kind)
    if as_json:
        from lm_train.planning.report import plan_json

        typer.echo(json.dumps(plan_json(plan_, xla)))
    else:
        from lm_train.planning.report import render_text

        typer.echo(render_text(plan_, " ".join(str(f) for f in files), xla))
