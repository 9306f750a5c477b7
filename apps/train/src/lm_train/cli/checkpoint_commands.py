"""Commands on a checkpoint: sample (generate text) and export-hf."""

from __future__ import annotations

from typing import Annotated

import typer

from lm_train.cli.app import CHECKPOINT_HELP, Debug, Weights, app, handles_user_errors


@app.command("export-hf")
@handles_user_errors
def export_hf(
    checkpoint: Annotated[str, typer.Argument(help=CHECKPOINT_HELP)],
    out_dir: Annotated[
        str, typer.Argument(help="Directory or s3:// / gs:// URL to write config.json, safetensors and tokenizer.")
    ],
    overwrite: Annotated[bool, typer.Option(help="Replace OUT_DIR if it already holds files.")] = False,
    dtype: Annotated[str | None, typer.Option(help="Cast weights, e.g. bfloat16 (default: as trained).")] = None,
    lora: Annotated[
        bool, typer.Option("--lora", help="LoRA runs: write the adapters as a PEFT adapter (peft loads it).")
    ] = False,
    merge: Annotated[
        bool, typer.Option("--merge", help="LoRA runs: write the model with its adapters merged into the weights.")
    ] = False,
    weights: Weights = None,
    debug: Debug = False,
) -> None:
    """Export a checkpoint as a Hugging Face model directory (transformers loads it), or a LoRA run's adapter."""
    from lm_train.tools.hf_export import export_checkpoint

    exported, chosen = export_checkpoint(
        checkpoint, out_dir, overwrite=overwrite, dtype=dtype, lora=lora, merge=merge, weights=weights
    )
    typer.echo(f"wrote {out_dir} (from {exported}, {chosen} weights)")


@app.command()
@handles_user_errors
def sample(
    checkpoint: Annotated[str, typer.Argument(help=CHECKPOINT_HELP)],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "def ",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.8,
    top_k: Annotated[int | None, typer.Option(help="Sample among the k most likely tokens.")] = None,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling threshold.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the sampler.")] = 0,
    weights: Weights = None,
    debug: Debug = False,
) -> None:
    """Generate text from a checkpoint."""
    from lm_train.tools.generate_text import sample_checkpoint

    text = sample_checkpoint(
        checkpoint,
        prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        weights=weights,
    )
    typer.echo(text)
