"""Commands that show what a run did: plot (metrics), viz (token log-probs), harness (lm-eval tasks)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lm_train.cli.app import Debug, app, handles_user_errors


@app.command()
@handles_user_errors
def plot(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories (runs/<id>), overlaid in one figure.")],
    out: Annotated[Path | None, typer.Option(help="Image to write (.png, .svg, .pdf); default RUN_DIR/plot.png.")] = (
        None
    ),
    metrics: Annotated[
        list[str] | None,
        typer.Option(
            help="Panels to draw (repeat the flag): loss, eval, lr, grad_norm, tokens_per_second, mfu, or any "
            "logged key such as watch/grads/norm/total. Default: every panel with data."
        ),
    ] = None,
    x: Annotated[str, typer.Option("--x", help="x axis: steps or tokens.")] = "steps",
    smoothing: Annotated[float, typer.Option(help="EMA weight of the smoothed train loss, in [0, 1).")] = 0.9,
    debug: Debug = False,
) -> None:
    """Plot train loss (raw and smoothed), eval losses, learning rate, grad norm, tokens/s and MFU of runs."""
    from lm_train.plotting import plot_runs

    target = out if out is not None else (run_dirs[0] if run_dirs else Path(".")) / "plot.png"
    written = plot_runs(run_dirs, target, metrics=metrics, x_axis=x, smoothing=smoothing)
    typer.echo(f"wrote {written}")
