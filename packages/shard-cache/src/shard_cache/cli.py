"""The `shard-cache` command line: build, inspect, verify (and repair) caches, and train a tokenizer.

One family with `lm-train`: Typer's help layout, errors as one paragraph `error: ...` with exit code 2
(usage errors too), 130 on Ctrl-C, 1 when `verify` finds a problem, and `--debug` for a traceback.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import typer

from shard_cache.errors import ShardCacheError

CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="shard-cache",
    help="Tokenized corpus caches built with Ray: build, inspect, verify, and train a tokenizer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT,
)

Debug = Annotated[bool, typer.Option("--debug", help="Show full tracebacks for errors.")]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bar or progress lines.")]
# The post-training record formats (shard_cache.formats.RECORD_FORMATS; spelled out so that --help needs no import).
RecordFormat = Annotated[
    Literal["text", "prompt_completion", "chat"],
    typer.Option(help="text (a text field), prompt_completion (prompt + completion fields) or chat (OpenAI messages)."),
]
ChatTemplate = Annotated[
    str | None,
    typer.Option(help="For chat: a .jinja file, a template name of the tokenizer directory, or the template itself."),
]
NoMaskUserTurns = Annotated[
    bool,
    typer.Option("--no-mask-user-turns", help="Train on every token, not only the completions / assistant turns."),
]


def _template_text(chat_template: str | None) -> str | None:
    """--chat-template as record_processor takes it: a .jinja file's text, else the name or template as given."""
    from pathlib import Path

    if chat_template is not None and chat_template.endswith(".jinja") and Path(chat_template).is_file():
        return Path(chat_template).read_text(encoding="utf-8")
    return chat_template


def handles_user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Known input errors become one paragraph and exit code 2; Ctrl-C exits 130; --debug shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ShardCacheError as e:
            if kwargs.get("debug"):
                traceback.print_exc()
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(code=130) from None

    return wrapper


def _log_to_stderr() -> None:
    """Warnings of the package (an empty input, a rebuilt ledger) as `warning: ...` lines on stderr."""
    logger = logging.getLogger("shard_cache")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_LevelPrefix())
        logger.addHandler(handler)
        logger.propagate = False


class _LevelPrefix(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


@app.command()
@handles_user_errors
def build(
    inputs: Annotated[
        list[str],
        typer.Argument(help="Paths or fsspec URLs (gs://, s3://, ...); globs and {1..N} ranges.", metavar="INPUT..."),
    ],
    tokenizer: Annotated[str, typer.Option(help="A tokenizer.json file or an HF tokenizer directory (path or URL).")],
    out: Annotated[str, typer.Option(help="The cache directory (a path or fsspec URL).")],
    fmt: Annotated[
        Literal["auto", "jsonl", "text", "lines", "parquet"],
        typer.Option("--format", help="Input format (auto: from the file suffix)."),
    ] = "auto",
    text_field: Annotated[str, typer.Option(help="The jsonl field or parquet column holding the text.")] = "text",
    chunk_size: Annotated[int, typer.Option(help="Documents per chunk.")] = 1024,
    files_per_shard: Annotated[int, typer.Option(help="Input files per shard, dealt round-robin.")] = 1,
    num_workers: Annotated[int | None, typer.Option(help="Parallel Ray tasks (default: the cluster's CPUs).")] = None,
    ray_address: Annotated[str | None, typer.Option(help="Join this Ray cluster instead of starting one.")] = None,
    in_process: Annotated[
        bool | None,
        typer.Option(
            "--in-process/--ray",
            help="Tokenize in this process, or with Ray tasks (default: in this process when the inputs total "
            "at most 4 MiB and no --ray-address is given).",
            show_default=False,
        ),
    ] = None,
    on_bad_input: Annotated[
        Literal["fail", "skip"], typer.Option(help="On a bad document: fail, or skip and count it.")
    ] = "fail",
    eos: Annotated[str | None, typer.Option(help="End-of-document token (default: from the tokenizer).")] = None,
    bos: Annotated[str | None, typer.Option(help="Beginning-of-document token, with --add-bos.")] = None,
    add_bos: Annotated[bool, typer.Option("--add-bos", help="Put a BOS token before each document.")] = False,
    record_format: RecordFormat = "text",
    chat_template: ChatTemplate = None,
    no_mask_user_turns: NoMaskUserTurns = False,
    no_progress: NoProgress = False,
    debug: Debug = False,
) -> None:
    """Tokenize INPUT files into a cache directory; rerun the same command to resume or repair its ledger."""
    from shard_cache.build import build_cache
    from shard_cache.formats import record_processor

    _log_to_stderr()
    processor = record_processor(
        record_format,
        tokenizer,
        chat_template=_template_text(chat_template),
        mask_user_turns=not no_mask_user_turns,
        eos_token=eos,
        bos_token=bos,
        add_bos=add_bos,
    )
    with _ray_of_this_command(ray_address):
        result = build_cache(
            inputs,
            out,
            processor=processor,
            fmt=fmt,
            text_field=text_field,
            chunk_size=chunk_size,
            files_per_shard=files_per_shard,
            on_bad_input=on_bad_input,
            num_workers=num_workers,
            ray_address=ray_address,
            in_process=in_process,
            progress=not no_progress,
        )
    typer.echo(
        f"built {result.cache_dir}: {result.shards} shards, {result.chunks} chunks, {result.docs} documents, "
        f"{result.tokens} tokens" + (f", skipped {result.skipped}" if result.skipped else "")
    )


class _ray_of_this_command:  # noqa: N801 (used as a context manager)
    """Shut down, before the interpreter exits, a local Ray that the command started (never a joined cluster
    that was already up): its C++ threads must not be running while Python finalises."""

    def __init__(self, address: str | None):
        self.address = address
        self.was_up = False

    @staticmethod
    def _ray_up() -> bool:
        ray = sys.modules.get("ray")
        return ray is not None and ray.is_initialized()

    def __enter__(self) -> _ray_of_this_command:
        self.was_up = self._ray_up()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.was_up and self._ray_up():
            sys.modules["ray"].shutdown()


@app.command()
@handles_user_errors
def inspect(
    cache_dir: Annotated[str, typer.Argument(help="The cache directory (a path or fsspec URL).", metavar="DIR")],
    debug: Debug = False,
) -> None:
    """Print a summary of a cache as JSON: shards, chunks, documents, tokens, skipped documents."""
    from shard_cache.verify import inspect_cache

    typer.echo(json.dumps(inspect_cache(cache_dir), indent=2))


@app.command()
@handles_user_errors
def verify(
    cache_dir: Annotated[str, typer.Argument(help="The cache directory (a path or fsspec URL).", metavar="DIR")],
    repair: Annotated[
        bool, typer.Option("--repair", help="Rebuild damaged chunks from their source shards (needs --tokenizer).")
    ] = False,
    tokenizer: Annotated[
        str | None, typer.Option(help="The cache's tokenizer.json or HF directory, for --repair.")
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(help="For --repair of a chat cache: its template, if the tokenizer directory lacks it."),
    ] = None,
    no_progress: NoProgress = False,
    debug: Debug = False,
) -> None:
    """Check every committed chunk's checksums and counts; exit 1 if a problem is found."""
    from shard_cache.repair import repair_cache
    from shard_cache.verify import verify_cache

    if repair and tokenizer is None:
        raise ShardCacheError("--repair needs --tokenizer: the tokenizer the cache was built with.")
    progress = not no_progress
    if repair:
        template = _template_text(chat_template)
        outcome = repair_cache(cache_dir, tokenizer=tokenizer, chat_template=template, progress=progress)
        for path in outcome.repaired:
            typer.echo(f"repaired: {path}", err=True)
        problems, checked = outcome.problems, outcome.chunks_checked
    else:
        report = verify_cache(cache_dir, progress=progress)
        problems, checked = report.problems, report.chunks_checked
    for problem in problems:
        typer.echo(f"problem: {problem}", err=True)
    if problems and not repair:
        typer.echo(
            f"fix: `shard-cache verify {cache_dir} --repair --tokenizer TOKENIZER` rebuilds damaged chunks from "
            "their sources; a damaged ledger is rebuilt by running the cache's build command again.",
            err=True,
        )
    typer.echo(f"{'FAILED' if problems else 'ok'}: {checked} chunks checked, {len(problems)} problems")
    if problems:
        raise typer.Exit(code=1)


@app.command("train-tokenizer")
@handles_user_errors
def train_tokenizer_command(
    inputs: Annotated[list[str], typer.Argument(help="Local text files (one document each).", metavar="FILE...")],
    vocab_size: Annotated[int, typer.Option(help="Size of the vocabulary.")],
    out: Annotated[str, typer.Option(help="Where to write tokenizer.json (a path or fsspec URL).")],
    debug: Debug = False,
) -> None:
    """Train a byte-level BPE tokenizer on text files."""
    from pathlib import Path

    from shard_cache.tokenizer_training import train_tokenizer

    tokenizer = train_tokenizer([Path(p) for p in inputs], vocab_size, save_path=out)
    typer.echo(f"wrote {out}: vocabulary of {tokenizer.get_vocab_size()}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit status (the console script exits with it)."""
    try:
        app(args=list(argv) if argv is not None else None, prog_name="shard-cache")
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
