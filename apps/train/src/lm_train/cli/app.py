"""The `lm-train` Typer app: its error handling, the options commands share, and the entry point.

Commands live in the modules beside this one; `lm_train.cli` imports them so that they register."""

from __future__ import annotations

import functools
import re
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


CHECKPOINT_HELP = (
    "A checkpoint (runs/<id>/checkpoints/step-N), a folder of them or a run directory (its newest checkpoint), "
    "local or at a gs:// / s3:// URL."
)
Weights = Annotated[
    str | None,
    typer.Option(
        metavar="ema|raw",
        help="The checkpoint's weight average (ema, kept by trainer.model_averaging) or its trained weights (raw); "
        "default: the weights the run's own exports hold (ema where it keeps one and export_ema is on).",
    ),
]
"""The help of a command's checkpoint argument."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input rather than a bug: shown as one paragraph, exit code 2."""
    kinds: list[type[BaseException]] = [UserError]
    for module, name in (
        ("dist_ckpt", "CheckpointError"),
        ("shard_cache", "ShardCacheError"),
        ("trackers", "TrackerConfigError"),
        ("hf_bridge", "HfBridgeError"),
    ):
        # Only packages already imported: one never imported raised nothing, and importing it here (dist_ckpt
        # and hf_bridge bring jax, ~2.5 s) would delay every config error's message.
        package = sys.modules.get(module)
        if package is not None and hasattr(package, name):
            kinds.append(getattr(package, name))
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
    """The config keys for `run --help`, one line each under a heading per section (rich markup escaped)."""
    from rich.markup import escape

    from lm_train.config.reference import help_sections

    return "\n\n".join(
        f"{escape(heading)}\n" + "\n".join(escape(line) for line in lines) for heading, lines in help_sections()
    )


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


def load_from_args(args: list[str], extra: list[str]):
    from lm_train.config import load_train_config

    files, overrides = split_arguments([*args, *extra])
    # `--on-bad-input skip` (shard-cache's flag) is short for `--data.on_bad_input skip`.
    overrides = [re.sub(r"^--on-bad-input(?=$|=)", "--data.on_bad_input", arg) for arg in overrides]
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


def distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    from lm_train.run.distributed import initialize_distributed

    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise UserError("--coordinator-address needs --num-processes and --process-id too.")
    initialize_distributed(coordinator_address, num_processes, process_id)


def train_processes(
    config: Any,
    files: Any,
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    kind: Any = None,
) -> Any:
    """Join the processes' distributed run and train (`kind`: the TrainingKind, default language modelling); a run
    stopped by a signal, its checkpoint saved, exits with 128 + the signal, which a scheduler does not take for
    success."""
    from lm_train.run.loop import train

    distributed(coordinator_address, num_processes, process_id)
    result = train(config, config_files=files) if kind is None else train(config, config_files=files, kind=kind)
    if result.exit_status:
        raise typer.Exit(result.exit_status)
    return result


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
