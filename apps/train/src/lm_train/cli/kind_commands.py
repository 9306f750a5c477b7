"""The training commands, one per row of the table of kinds (lm_train.kinds): `lm-train run`, `dpo`, `doremi`.

Each takes config files and overrides, its kind's options and the multi-process options; it checks the config as
its kind asks, trains, and hands the finished run to the kind (DoReMi writes its averaged weights). Rerun to resume.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Annotated, Any

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
from lm_train.kinds import KINDS, KindEntry, KindOption

SkipMemoryCheck = Annotated[
    bool,
    typer.Option(
        "--skip-memory-check",
        help="Run even where the plan's estimate or XLA's compiled figure exceeds the devices' memory (env "
        "LM_TRAIN_SKIP_MEMORY_CHECK=1; LM_TRAIN_MEMORY_LIMIT sets the limit per device).",
    ),
]


def with_key(config: Any, dotted: str, value: Any) -> Any:
    """The config with one dotted key (section.key, ...) set to `value`."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(config, **{head: value})
    return dataclasses.replace(config, **{head: with_key(getattr(config, head), rest, value)})


def _parameter_name(option: KindOption) -> str:
    return option.flag.lstrip("-").replace("-", "_")


def _keyword(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _signature(entry: KindEntry) -> inspect.Signature:
    """ctx, the config files, the kind's options, then the options every training command has."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    options = [
        _keyword(_parameter_name(o), Annotated[str | None, typer.Option(o.flag, help=o.help)], None)
        for o in entry.options
    ]
    return inspect.Signature(
        [
            inspect.Parameter("ctx", positional, annotation=typer.Context),
            inspect.Parameter("configs", positional, annotation=ConfigFiles),
            *options,
            _keyword("coordinator_address", CoordinatorAddress, None),
            _keyword("num_processes", NumProcesses, None),
            _keyword("process_id", ProcessId, None),
            _keyword("skip_memory_check", SkipMemoryCheck, False),
            _keyword("debug", Debug, False),
        ]
    )


def _train_command(entry: KindEntry) -> Any:
    """`lm-train <entry.command>`: load the config, apply the kind's options and checks, train, finish."""

    def command(ctx: typer.Context, configs: list[str], **options: Any) -> None:
        config, files = load_from_args(configs, ctx.args)  # first: a config error costs no training import
        for option in entry.options:
            value = options.get(_parameter_name(option))
            if value is not None:
                config = with_key(config, option.key, value)
        if options.get("skip_memory_check"):
            os.environ["LM_TRAIN_SKIP_MEMORY_CHECK"] = "1"  # read where the checks run, in this process
        kind = entry.load()
        kind.check_config(config)
        process = (options.get("coordinator_address"), options.get("num_processes"), options.get("process_id"))
        result = train_processes(config, files, *process, kind=kind)
        if kind.finish is not None and result.final_step >= config.trainer.num_train_steps:
            import jax

            if jax.process_index() == 0:
                kind.finish(config, result)

    signature = _signature(entry)
    command.__signature__ = signature  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    command.__name__ = command.__qualname__ = entry.command
    command.__doc__ = entry.help
    return command


for _entry in KINDS:
    app.command(_entry.command, context_settings=CONTEXT, epilog=_entry.epilog)(
        handles_user_errors(_train_command(_entry))
    )
