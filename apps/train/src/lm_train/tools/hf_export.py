"""Hugging Face exports: `lm-train export-hf`, and the exports a run makes as it trains.

hf-bridge writes the sharded model tensor by tensor (process 0 writes, every process takes part), so no
process ever holds the whole model on its host. A LoRA run exports its adapters as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors), or the merged model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import hf_bridge
import named_tensors as nt
from lm_train.config.schema import TrainLmConfig
from lm_train.errors import CheckpointError, ExportError, UserError
from lm_train.post.lora_training import has_adapters, merged
from lm_train.run.checkpoints import load_model
from lm_train.run.model_averaging import check_weights
from lm_train.run.run_dir import RunPaths
from lm_train.tools.peft_export import export_adapter


def exportable(model: Any, model_config: Any) -> tuple[Any, Any]:
    """The model and its config as Hugging Face holds them: training-only parts (DeepSeek-V3's multi-token
    prediction depths) left out."""
    for_export = getattr(model, "for_export", None)
    out = model if for_export is None else for_export()
    return (model, model_config) if out is model else (out, out.config)


def export_model(model: Any, model_config: Any, tokenizer_file: Path, out_dir: str, *, overwrite: bool) -> None:
    """Write config.json, sharded safetensors and the tokenizer (every process must call this)."""
    # A Hugging Face checkpoint holds weights, not fp8/int8 scaling state, nor the MTP depths.
    model, model_config = exportable(nt.nn.plain_linears(model), model_config)
    hf_bridge.save_pretrained(model, model_config, out_dir, tokenizer=str(tokenizer_file), overwrite=overwrite)


def export_during_training(config: TrainLmConfig, paths: RunPaths, model: Any, step: int) -> str:
    """The export a run makes at its end and every hf_save_steps: <hf_save_path or run_dir/hf>/step-N.

    With LoRA: the PEFT adapter at <peft_save_path or run_dir/hf>/step-N, and the merged model at
    <merged_hf_save_path>/step-N when that is set.
    """
    # Strings, not Paths: Path("s3://bucket/x") would collapse the URL's double slash.
    if has_adapters(model):
        out = f"{(config.peft_save_path or str(paths.hf)).rstrip('/')}/step-{step}"
        export_adapter(model, config, out, overwrite=True)
        if config.merged_hf_save_path:
            whole = f"{config.merged_hf_save_path.rstrip('/')}/step-{step}"
            export_model(merged(model), config.model, paths.tokenizer_file, whole, overwrite=True)
        return out
    base = config.hf_save_path.rstrip("/") if config.hf_save_path else str(paths.hf)
    out = f"{base}/step-{step}"
    export_model(model, config.model, paths.tokenizer_file, out, overwrite=True)
    return out


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str,
    *,
    overwrite: bool = False,
    dtype: str | None = None,
    lora: bool = False,
    merge: bool = False,
    weights: str | None = None,
) -> tuple[str | Path, str]:
    """Export a run's checkpoint as a Hugging Face model directory (or, with `lora`, its PEFT adapter; with
    `merge`, the model with its adapters merged); `weights`: its `ema` or `raw` weights (None: the run's choice,
    as its own exports). Returns the checkpoint it exported and which of its weights (`ema` or `raw`)."""
    if lora and merge:
        raise UserError("--lora writes the adapter and --merge the merged model: give one of them.")
    if lora and dtype is not None:
        raise UserError("--dtype applies to full models; a PEFT adapter keeps the adapters as trained (float32).")
    check_weights(weights)
    hf_bridge.check_export_target(out_dir, overwrite=overwrite)  # a full or unreachable destination: before the load
    loaded = load_model(checkpoint, weights)
    adapted = has_adapters(loaded.model)
    if (lora or merge) and not adapted:
        flag = "--lora" if lora else "--merge"
        raise CheckpointError(
            f"{flag}: {loaded.checkpoint} has no LoRA adapters (its run has no `lora` section); export it without "
            f"{flag}."
        )
    if adapted and not (lora or merge):
        raise CheckpointError(
            f"{loaded.checkpoint} holds LoRA adapters on the model of {loaded.config.initialize_from_hf}: pass "
            "--lora to write them as a PEFT adapter, or --merge to write the model with the adapters merged."
        )
    if lora:
        export_adapter(loaded.model, loaded.config, out_dir, overwrite=overwrite)
        return loaded.checkpoint, loaded.weights
    model, model_config = exportable(nt.nn.plain_linears(merged(loaded.model)), loaded.config.model)
    hf_bridge.save_pretrained(
        model,
        model_config,
        out_dir,
        tokenizer=str(loaded.paths.tokenizer_file),
        dtype=dtype,
        overwrite=overwrite,
    )
    check_export(model, out_dir, dtype=dtype, source=str(loaded.checkpoint))
    return loaded.checkpoint, loaded.weights


def check_export(model: Any, out_dir: str, *, dtype: str | None, source: str) -> None:
    """Load an export once and compare every tensor with the model it was written from (cast to `dtype`)."""
    # hf_bridge already checked the index, each file's size and a few tensors' bytes as it wrote them; this
    # reads the directory back through the loader, so a fault in storage or in the name mapping shows too.
    try:
        back = hf_bridge.load_weights(out_dir, model)
    except hf_bridge.HfBridgeError as e:
        raise ExportError(
            f"The export at {out_dir} does not load back: {e} Export {source} again with --overwrite; if it fails "
            "again, the storage under that directory does not keep what is written."
        ) from None
    wanted = jax.tree_util.tree_leaves_with_path(model)
    for (path, ours), theirs in zip(wanted, jax.tree_util.tree_leaves(back), strict=True):
        expected = ours.astype(dtype).astype(theirs.dtype) if dtype else ours.astype(theirs.dtype)
        if not bool(jnp.array_equal(_bits(expected), _bits(theirs))):
            raise ExportError(
                f"The export at {out_dir} reads back tensor `{jax.tree_util.keystr(path)}` with other values than "
                f"{source}: the files were damaged after they were written. Export it again with --overwrite; if "
                "it fails again, the storage under that directory does not keep what is written."
            )


def _bits(values: jax.Array) -> jax.Array:
    """The bit patterns of float values, so that a flipped bit in a subnormal or a NaN is seen too."""
    # A float comparison on CPU flushes subnormals to zero, and would call a damaged 0.0 equal.
    unsigned = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[values.dtype.itemsize]
    return jax.lax.bitcast_convert_type(values, unsigned)
