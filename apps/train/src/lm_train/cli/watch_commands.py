"""Commands that show what a run did: plot (metrics), viz (token log-probs), harness (lm-eval tasks)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lm_train.cli.app import CHECKPOINT_HELP, Debug, app, handles_user_errors


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
    from lm_train.tools.plotting import plot_runs

    target = out if out is not None else (run_dirs[0] if run_dirs else Path(".")) / "plot.png"
    written = plot_runs(run_dirs, target, metrics=metrics, x_axis=x, smoothing=smoothing)
    typer.echo(f"wrote {written}")


@app.command()
@handles_user_errors
def viz(
    checkpoint: Annotated[str, typer.Argument(help=CHECKPOINT_HELP)],
    out: Annotated[Path, typer.Option(help="HTML page to write.")] = Path("logprobs.html"),
    data: Annotated[
        list[str] | None,
        typer.Option(help="Documents to show (files, URLs, globs; repeat the flag); default: the run's validation."),
    ] = None,
    compare: Annotated[
        Path | None,
        typer.Option(help="A baseline checkpoint: shade each token by CHECKPOINT's log-prob minus the baseline's."),
    ] = None,
    max_docs: Annotated[int, typer.Option(help="Documents on the page.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Tokens shown of each document.")] = 400,
    batch_size: Annotated[int | None, typer.Option(help="Rows per scoring batch (default: the eval batch).")] = None,
    debug: Debug = False,
) -> None:
    """Write one self-contained HTML page of documents, each token shaded by its log-prob (value on hover)."""
    from lm_train.tools.logprob_viz import visualize

    written = visualize(
        checkpoint,
        out,
        data=data or (),
        compare=compare,
        max_docs=max_docs,
        max_tokens=max_tokens,
        batch_size=batch_size,
    )
    typer.echo(f"wrote {written}")


@app.command()
@handles_user_errors
def harness(
    checkpoint: Annotated[str, typer.Argument(help=CHECKPOINT_HELP)],
    tasks: Annotated[
        list[str] | None,
        typer.Option(
            help="lm-eval task to run (repeat the flag); built-in: stdlib_next_line_mc, stdlib_line_completion, "
            "stdlib_perplexity."
        ),
    ] = None,
    max_examples: Annotated[int | None, typer.Option(help="Examples per task (default: all).")] = None,
    include_path: Annotated[str | None, typer.Option(help="A directory of your own lm-eval YAML tasks.")] = None,
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples (default: each task's).")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Rows per batch (default: the eval batch).")] = None,
    out: Annotated[
        Path | None, typer.Option(help="JSON file of the scores; default RUN_DIR/harness/step-N.json.")
    ] = None,
    log_samples: Annotated[
        bool, typer.Option(help="Also write each example's inputs and outputs to the JSON.")
    ] = False,
    debug: Debug = False,
) -> None:
    """Run lm-evaluation-harness tasks (offline, local files) on a checkpoint; scores as harness/<task>/<metric>."""
    from lm_train.tools.harness.on_checkpoint import harness_checkpoint

    metrics, written, _ = harness_checkpoint(
        checkpoint,
        tasks or ["stdlib_next_line_mc", "stdlib_line_completion"],
        max_examples=max_examples,
        include_path=include_path,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        out=out,
        log_samples=log_samples,
    )
    for key, value in metrics.items():
        typer.echo(f"{key} {value:.4f}")
    typer.echo(f"wrote {written}")
