"""`lm-train serve`: an OpenAI-compatible HTTP server for a checkpoint, a run or a Hugging Face export."""

from __future__ import annotations

from typing import Annotated

import typer

from lm_train.cli.app import Debug, Weights, app, handles_user_errors


@app.command()
@handles_user_errors
def serve(
    source: Annotated[
        str, typer.Argument(help="A checkpoint, a run directory (its newest checkpoint) or a Hugging Face export.")
    ],
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    max_pages: Annotated[
        int | None, typer.Option(help="KV-cache pages in the pool (default: --memory-fraction of free memory).")
    ] = None,
    memory_fraction: Annotated[float, typer.Option(help="Share of free device memory for the KV cache.")] = 0.25,
    page_size: Annotated[int, typer.Option(help="Tokens per KV-cache page.")] = 16,
    max_seqs: Annotated[int, typer.Option(help="Sequences decoded together.")] = 16,
    prefill_chunk: Annotated[int, typer.Option(help="Prompt tokens read per prompt and step.")] = 64,
    decode_steps: Annotated[
        int,
        typer.Option(
            help="Tokens decoded per sequence and host round trip while no request waits to join (more: "
            "faster decoding; a new request may wait that many steps)."
        ),
    ] = 16,
    max_concurrent: Annotated[
        int, typer.Option(help="Requests that may wait beyond the running ones; more get HTTP 429.")
    ] = 256,
    api_key: Annotated[
        str | None,
        typer.Option(help="Require 'Authorization: Bearer KEY' (all but /health).", envvar="LM_TRAIN_API_KEY"),
    ] = None,
    chat_template: Annotated[
        str | None, typer.Option(help="A jinja chat template (default: the tokenizer's, else ChatML).")
    ] = None,
    lora: Annotated[str | None, typer.Option(help="A PEFT adapter directory, merged into the weights at load.")] = None,
    model_name: Annotated[str | None, typer.Option(help="The model's name in the API (default: SOURCE's).")] = None,
    weights: Weights = None,
    graceful_stop: Annotated[
        int,
        typer.Option(
            help="Seconds that SIGTERM lets the requests in flight finish before cancelling them (0: at once)."
        ),
    ] = 30,
    debug: Debug = False,
) -> None:
    """Serve a model with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, /health)."""
    from lm_train.serve.engine_config import EngineConfig
    from lm_train.serve.run import check_serve_options
    from lm_train.serve.run import serve as run_server

    config = EngineConfig(
        page_size=page_size,
        num_pages=max_pages,
        memory_fraction=memory_fraction,
        max_seqs=max_seqs,
        prefill_chunk=prefill_chunk,
        max_waiting=max_concurrent,
        decode_steps=decode_steps,
    )
    check_serve_options(config, host, port, graceful_stop)
    run_server(source, config, host=host, port=port, api_key=api_key, chat_template=chat_template, name=model_name,
               lora=lora, weights=weights, graceful_stop=graceful_stop)  # fmt: skip
