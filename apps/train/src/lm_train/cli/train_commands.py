"""Commands on a config: eval, cache, config show (the training commands come from the table of kinds)."""

from __future__ import annotations

from typing import Annotated

import typer

from lm_train.cli.app import (
    CONTEXT,
    ConfigFiles,
    Debug,
    Weights,
    app,
    config_app,
    handles_user_errors,
    load_from_args,
)


@app.command(context_settings=CONTEXT)
@handles_user_errors
def eval(
    ctx: typer.Context,
    configs: ConfigFiles,
    checkpoint: Annotated[str | None, typer.Option(help="Checkpoint directory; default: the newest.")] = None,
    weights: Weights = None,
    debug: Debug = False,
) -> None:
    """Evaluate a checkpoint on the config's validation data and print the loss."""
    config, files = load_from_args(configs, ctx.args)
    if config.data.is_mixture:  # every source's loss and the weighted eval/loss
        from lm_train.run.evaluation import evaluate_checkpoint
    else:
        from lm_train.run.evaluation import evaluate_checkpoint

    result, evaluated, chosen = evaluate_checkpoint(config, checkpoint, files, weights)
    typer.echo(f"evaluated {evaluated} ({chosen} weights)")
    typer.echo(f"eval/loss {result['eval/loss']:.4f}  eval/perplexity {result['eval/perplexity']:.2f}")
    for key in sorted(k for k in result if k.endswith("/loss") and k != "eval/loss"):  # a mixture's sources
        typer.echo(f"{key} {result[key]:.4f}")


@app.command(context_settings=CONTEXT)
@handles_user_errors
def cache(ctx: typer.Context, configs: ConfigFiles, debug: Debug = False) -> None:
    """Build the config's tokenizer and data cache ahead of training."""
    from lm_train.data.caches import prepare_any_data

    config, _ = load_from_args(configs, ctx.args)
    data = prepare_any_data(config.data, background=False)
    typer.echo(f"cache ready: {data.describe()}")


@config_app.command("show", context_settings=CONTEXT)
@handles_user_errors
def config_show(ctx: typer.Context, configs: ConfigFiles, debug: Debug = False) -> None:
    """Print the resolved config (includes, overrides and defaults applied) as YAML."""
    from lm_train.config.loading import dump_config

    config, _ = load_from_args(configs, ctx.args)
    typer.echo(dump_config(config), nl=False)
