"""Saving lm_models models as Hugging Face checkpoints that transformers' AutoModelForCausalLM loads.

The export streams: one tensor at a time is fetched from the (possibly sharded, possibly multi-host) model
into host memory and written, so host memory holds about one tensor whatever the model's size. In a
multi-process run every process calls `save_pretrained` with its part of the model; process 0 writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
from tokenizers import Tokenizer

from lm_models import HfTensor, LmConfig
from named_tensors import NamedArray

from .config import our_config_to_hf
from .errors import HfBridgeError
from .gather import fill
from .layout import hf_shape, hf_view_as_ours, part_region
from .load import check_compatible, float_dtype
from .mapping import family_for_ours
from .multihost import Coordinator
from .output_dir import OutputDir
from .params import LAYERS, ParamSlot, axis_names, axis_sizes, named_leaves
from .reader import CONFIG_FILE
from .tokenizer import default_special_tokens, load_special_tokens, load_tokenizer, special_token_ids, tokenizer_files
from .verify import verify_export
from .writer import PlannedTensor, Progress, parse_size, plan_shards, write_shards

GENERATION_CONFIG = "generation_config.json"


def save_pretrained(
    model: Any,
    config: LmConfig,
    path: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: Any = None,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    special_tokens: Mapping[str, str] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> None:
    """Write an HF checkpoint directory (config.json, safetensors weights, tokenizer) for model and config.

    `path` is a local directory or an fsspec URL (s3://, gs://, ...). The model's arrays may be sharded jax
    arrays, across processes too: every process calls this, each tensor is fetched shard by shard, process 0
    writes, and all return (or raise the same error) once the export is written and checked. `dtype` casts
    the weights (default: as they are); weights beyond `max_shard_size` are split into
    model-0000K-of-0000N.safetensors files with an index. `tokenizer` is a tokenizers.Tokenizer or the path
    of a tokenizer.json / HF tokenizer directory (whose special tokens are kept unless `special_tokens` says
    otherwise). An existing non-empty directory is replaced only with overwrite=True. `progress(done, total)`
    is called on process 0 with the bytes of weights written.
    """
    family = family_for_ours(config.model_type)
    if not isinstance(getattr(model, "config", None), LmConfig):
        raise HfBridgeError(f"save_pretrained needs an lm_models model, got {type(model).__name__}.")
    check_compatible(model.config, config, "model.config", also=("seq_len",), other="the config given to save")
    out_dtype = None if dtype is None else float_dtype(dtype, "save_pretrained")
    leaves, _ = named_leaves(model)
    dtype_name = str(out_dtype or np.dtype(leaves[0][1].dtype))
    planned = _plan(family.tensors(config), leaves, config.num_layers, out_dtype)
    shards = plan_shards(planned, parse_size(max_shard_size))
    co = Coordinator()
    # Both are None on the processes that write nothing; co.run calls what uses them on the writer only.
    extras = cast(dict[str, bytes], co.run(lambda: _extra_files(model, config, dtype_name, tokenizer, special_tokens)))
    out = cast(OutputDir, co.run(lambda: OutputDir(path, overwrite).open()))  # last before the try: nothing else fails
    co.agree()
    try:
        written = write_shards(out, shards, co, progress)
        co.run(lambda: [out.write_bytes(name, data) for name, data in extras.items() if name != CONFIG_FILE])
        co.run(lambda: verify_export(out.written(), written, out))
        # Last: a directory with config.json is a complete checkpoint.
        co.run(lambda: out.write_bytes(CONFIG_FILE, extras[CONFIG_FILE]))
        co.run(lambda: out.publish())
        co.agree()
    except BaseException:
        if out is not None:
            out.discard()
        raise


def _extra_files(
    model: Any,
    config: LmConfig,
    dtype_name: str,
    tokenizer: Tokenizer | str | os.PathLike | None,
    special_tokens: Mapping[str, str] | None,
) -> dict[str, bytes]:
    """config.json, generation_config.json and the tokenizer files, by name."""
    tok, special = _tokenizer_and_specials(tokenizer, special_tokens)
    token_ids = special_token_ids(tok, special) if tok is not None else {}
    if tok is not None and tok.get_vocab_size() > model.Vocab.size:
        raise HfBridgeError(
            f"The tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary has only "
            f"{model.Vocab.size}; save the tokenizer the model was trained with."
        )
    hf_config = our_config_to_hf(
        config,
        model.Vocab.size,
        bos_token_id=token_ids.get("bos_token_id"),
        eos_token_id=token_ids.get("eos_token_id"),
        pad_token_id=token_ids.get("pad_token_id"),
        dtype=dtype_name,
    )
    files = {CONFIG_FILE: _json_bytes(hf_config)}
    generation = {k: v for k, v in token_ids.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if generation:
        files[GENERATION_CONFIG] = _json_bytes(generation)
    if tok is not None:
        files.update(tokenizer_files(tok, special_tokens=special, model_max_length=config.seq_len))
    return files


def _tokenizer_and_specials(
    tokenizer: Tokenizer | str | os.PathLike | None, special_tokens: Mapping[str, str] | None
) -> tuple[Tokenizer | None, dict[str, str]]:
    if tokenizer is None:
        if special_tokens:
            raise HfBridgeError("special_tokens were given without a tokenizer to save them with.")
        return None, {}
    if isinstance(tokenizer, Tokenizer):
        tok, found = tokenizer, default_special_tokens(tokenizer)
    elif isinstance(tokenizer, str | os.PathLike):
        tok, found = load_tokenizer(tokenizer), load_special_tokens(tokenizer)
        found = found or default_special_tokens(tok)
    else:
        raise HfBridgeError(
            f"tokenizer must be a tokenizers.Tokenizer or a path to a tokenizer, got {type(tokenizer).__name__}."
        )
    return tok, dict(found if special_tokens is None else special_tokens)


def _plan(
    specs: list[HfTensor], leaves: list[tuple[ParamSlot, NamedArray]], num_layers: int, dtype: np.dtype | None
) -> list[PlannedTensor]:
    """One planned tensor per HF key, in the order of the family's tensor list (a per-layer one for each layer)."""
    by_path = {(slot.path, slot.layer is not None): (slot, leaf) for slot, leaf in leaves}
    seq_layers: dict[tuple[str, int | None], NamedArray] = {
        (slot.path, slot.layer): leaf for slot, leaf in leaves if isinstance(slot.layer, int)
    }
    planned = []
    for spec in specs:
        for layer in spec.layer_list(num_layers):
            parts = []
            for part in spec.parts:
                try:
                    slot, leaf = by_path[(part.path, spec.per_layer)]
                except KeyError:
                    raise HfBridgeError(
                        f"The model has no parameter {part.path!r} for the Hugging Face tensor {spec.key!r}; "
                        "lm_models and hf_bridge are out of step (please report this)."
                    ) from None
                if isinstance(slot.layer, int):
                    leaf = seq_layers[(part.path, layer)]
                parts.append((leaf, slot.stacked))
            out_dtype = dtype or np.dtype(parts[0][0].dtype)
            sizes = [axis_sizes(leaf) for leaf, _ in parts]
            shape = hf_shape(spec, sizes)
            for entry in spec.entries(sizes[0]):  # one HF tensor per entry of a split axis (Mixtral's experts)
                make = _maker(spec, parts, layer, entry, shape, out_dtype)
                planned.append(PlannedTensor(spec.key_for(layer, entry), out_dtype, shape, make))
    return planned


def _maker(
    spec: HfTensor,
    parts: list[tuple[NamedArray, bool]],
    layer: int | None,
    entry: int | None,
    shape: tuple[int, ...],
    dtype: np.dtype,
) -> Callable[[bool], np.ndarray | None]:
    sizes = [axis_sizes(leaf) for leaf, _ in parts]

    def make(writer: bool) -> np.ndarray | None:
        """The HF tensor on the writer (None elsewhere), each part's shards copied straight into its place."""
        out = np.empty(shape, dtype) if writer else None
        for index, (leaf, stacked) in enumerate(parts):
            names = [a.name for a in leaf.axes]
            select: dict[int, int] = {}
            if stacked:
                assert layer is not None  # a stacked leaf's tensor is one layer's
                select[names.index(LAYERS)] = layer
            if entry is not None:
                assert spec.split_axis is not None  # entries are the positions along the split axis
                select[names.index(spec.split_axis)] = entry
            target = None
            if out is not None:
                region = part_region(spec, index, out, sizes)
                ours = [n for n in axis_names(leaf) if n != spec.split_axis]
                target = hf_view_as_ours(spec.parts[index], region, ours, sizes[index])
            fill(target, leaf.array, select)
        return out

    return make


def _json_bytes(content: Any) -> bytes:
    return (json.dumps(content, indent=2) + "\n").encode("utf-8")
