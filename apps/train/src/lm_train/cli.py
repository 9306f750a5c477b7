"""The `lm-train` command line: run, eval, sample, export-hf, cache and config show."""

from __future__ import annotations

import functools
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from lm_train.errors import UserError

CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="lm-train",
    help="Train, evaluate, sample and export language models on named tensors.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

Debug = Annotated[bool, typer.Option("--debug", help="Show full tracebacks for errors.")]
ConfigFiles = Annotated[
    list[str],
    typer.Argument(
        help="CONFIG.yaml [MORE.yaml ...] [--dotted.key value ...]: config files merged in order (later files "
        "win), then overrides.",
        show_default=False,
        metavar="CONFIG.yaml... [--key value]...",
    ),
]


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input rather than a bug: shown as one paragraph, exit code 2."""
    kinds: list[type[BaseException]] = [UserError]
    for module, name in (
        ("dist_ckpt", "CheckpointError"),
        ("shard_cache", "ShardCacheError"),
        ("trackers", "TrackerConfigError"),
        ("hf_bridge", "HfBridgeError"),
    ):
        try:
            kinds.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(kinds)


def handles_user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn known input errors into a clear message and exit code 2; --debug shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = bool(kwargs.get("debug"))
        try:
            return fn(*args, **kwargs)
        except _user_errors() as e:
            if debug:
                traceback.print_exc()
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(code=130) from None

    return wrapper


def _config_key_help() -> str:
    from lm_train.config.reference import config_key_lines

    return "\n\n".join(config_key_lines())


def split_arguments(args: list[str]) -> tuple[list[Path], list[str]]:
    """Config files are the leading arguments; everything from the first `--key` on is an override."""
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            files, overrides = args[:i], args[i:]
            break
    else:
        files, overrides = args, []
    if not files:
        raise UserError("Give at least one config file, e.g. `lm-train run configs/gpt2_nano.yaml`.")
    return [Path(f) for f in files], overrides


def _load(args: list[str], extra: list[str]):
    from lm_train.config import load_train_config

    files, overrides = split_arguments([*args, *extra])
    config, _ = load_train_config(files, overrides)
    return config, files


CoordinatorAddress = Annotated[
    str | None,
    typer.Option(
        "--coordinator-address",
        help="host:port of process 0, for multi-process runs (env LM_TRAIN_COORDINATOR_ADDRESS).",
    ),
]
NumProcesses = Annotated[
    int | None, typer.Option("--num-processes", help="Processes in the run (env LM_TRAIN_NUM_PROCESSES).")
]
ProcessId = Annotated[int | None, typer.Option("--process-id", help="This process's index (env LM_TRAIN_PROCESS_ID).")]


def _distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    from lm_train.distributed import initialize_distributed

    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise UserError("--coordinator-address needs --num-processes and --process-id too.")
    initialize_distributed(coordinator_address, num_processes, process_id)


@app.command(context_settings=CONTEXT, epilog="Config keys, each settable as --key value:\n\n" + "{KEYS}")
@handles_user_errors
def run(
    ctx: typer.Context,
    configs: ConfigFiles,
    coordinator_address: CoordinatorAddress = None,
    num_processes: NumProcesses = None,
    process_id: ProcessId = None,
    debug: Debug = False,
) -> None:
    """Train: `lm-train run CONFIG.yaml [--trainer.num_train_steps 500 ...]`; rerun to resume."""
    from lm_train.trainer import train

    config, files = _load(configs, ctx.args)
    _distributed(coordinator_address, num_processes, process_id)
    train(config, config_files=files)


@app.command(context_settings=CONTEXT)
@handles_user_errors
def eval(
    ctx: typer.Context,
    configs: ConfigFiles,
    checkpoint: Annotated[Path | None, typer.Option(help="Checkpoint directory; default: the newest.")] = None,
    debug: Debug = False,
) -> None:
    """Evaluate a checkpoint on the config's validation data and print the loss."""
    from lm_train.evaluate import evaluate_checkpoint

    config, files = _load(configs, ctx.args)
    result = evaluate_checkpoint(config, checkpoint, files)
    typer.echo(f"eval/loss {result['eval/loss']:.4f}  eval/perplexity {result['eval/perplexity']:.2f}")


@app.command("export-hf")
@handles_user_errors
def export_hf(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory (runs/<id>/checkpoints/step-N).")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write config.json, safetensors and tokenizer.")],
    overwrite: Annotated[bool, typer.Option(help="Replace OUT_DIR if it already holds files.")] = False,
    dtype: Annotated[str | None, typer.Option(help="Cast weights, e.g. bfloat16 (default: as trained).")] = None,
    debug: Debug = False,
) -> None:
    """Export a checkpoint as a Hugging Face model directory (transformers loads it)."""
    from lm_train.export import export_checkpoint

    export_checkpoint(checkpoint, out_dir, overwrite=overwrite, dtype=dtype)
    typer.echo(f"wrote {out_dir}")


@app.command()
@handles_user_errors
def sample(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory (runs/<id>/checkpoints/step-N).")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "def ",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.8,
    top_k: Annotated[int | None, typer.Option(help="Sample among the k most likely tokens.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling threshold.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the sampler.")] = 0,
    debug: Debug = False,
) -> None:
    """Generate text from a checkpoint."""
    from lm_train.sampling import sample_checkpoint

    text = sample_checkpoint(
        checkpoint,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
    )
    typer.echo(text)


@app.command(context_settings=CONTEXT)
@handles_user_errors
def cache(ctx: typer.Context, configs: ConfigFiles, debug: Debug = False) -> None:
    """Build the config's tokenizer and data cache ahead of training."""
    from lm_train.data.pipeline import prepare_data

    config, _ = _load(configs, ctx.args)
    data = prepare_data(config.data, background=False)
    typer.echo(f"cache ready: {data.describe()}")


@config_app.command("show", context_settings=CONTEXT)
@handles_user_errors
def config_show(ctx: typer.Context, configs: ConfigFiles, debug: Debug = False) -> None:
    """Print the resolved config (includes, overrides and defaults applied) as YAML."""
    from lm_train.config.loading import dump_config

    config, _ = _load(configs, ctx.args)
    typer.echo(dump_config(config), nl=False)


def main() -> None:
    """Entry point that also fills the `run --help` key list lazily."""
    if "--help" in sys.argv or "-h" in sys.argv:
        command = typer.main.get_command(app)
        run_command = command.commands.get("run")  # type: ignore[attr-defined]
        if run_command is not None and run_command.epilog:
            run_command.epilog = run_command.epilog.replace("{KEYS}", _config_key_help())
        command()
        return
    app()
