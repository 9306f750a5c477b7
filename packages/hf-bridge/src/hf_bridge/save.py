"""Saving lm_models models as Hugging Face checkpoints that transformers' AutoModelForCausalLM loads."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tokenizers import Tokenizer

from lm_models import LmConfig
from named_tensors import NamedArray

from .config import our_config_to_hf
from .errors import HfBridgeError
from .families import family_for_ours
from .layout import HfTensor, hf_shape, ours_to_hf
from .load import check_compatible, float_dtype
from .output_dir import OutputDir
from .params import ParamSlot, axis_names, axis_sizes, named_leaves
from .tokenizer import default_special_tokens, load_special_tokens, load_tokenizer, save_tokenizer, special_token_ids
from .writer import PlannedTensor, parse_size, plan_shards, write_shards

CONFIG_FILE = "config.json"
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
) -> None:
    """Write an HF checkpoint directory (config.json, safetensors weights, tokenizer) for model and config.

    `path` is a local directory or an fsspec URL. `dtype` casts the weights (default: as they are);
    weights beyond `max_shard_size` are split into shards with an index. `tokenizer` is a tokenizers.Tokenizer
    or the path of a tokenizer.json / HF tokenizer directory (whose special tokens are kept unless
    `special_tokens` says otherwise). An existing non-empty directory is replaced only with overwrite=True,
    and only once the new checkpoint is complete.
    """
    family = family_for_ours(config.model_type)
    if not isinstance(getattr(model, "config", None), LmConfig):
        raise HfBridgeError(f"save_pretrained needs an lm_models model, got {type(model).__name__}.")
    check_compatible(model.config, config, "model.config", also=("seq_len",), other="the config given to save")
    out_dtype = None if dtype is None else float_dtype(dtype, "save_pretrained")
    tok, special = _tokenizer_and_specials(tokenizer, special_tokens)
    token_ids = special_token_ids(tok, special) if tok is not None else {}
    if tok is not None and tok.get_vocab_size() > model.Vocab.size:
        raise HfBridgeError(
            f"The tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary has only "
            f"{model.Vocab.size}; save the tokenizer the model was trained with."
        )
    leaves, _ = named_leaves(model)
    dtype_name = str(out_dtype or np.dtype(leaves[0][1].dtype))
    hf_config = our_config_to_hf(
        config,
        model.Vocab.size,
        bos_token_id=token_ids.get("bos_token_id"),
        eos_token_id=token_ids.get("eos_token_id"),
        pad_token_id=token_ids.get("pad_token_id"),
        dtype=dtype_name,
    )
    planned = _plan(family.tensors(config), leaves, config.num_layers, out_dtype)
    shards = plan_shards(planned, parse_size(max_shard_size))
    with OutputDir(path, overwrite) as directory:
        write_shards(directory, shards)
        _write_json(directory / CONFIG_FILE, hf_config)
        generation = {k: v for k, v in token_ids.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        if generation:
            _write_json(directory / GENERATION_CONFIG, generation)
        if tok is not None:
            save_tokenizer(tok, directory, special_tokens=special, model_max_length=config.seq_len)


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
    seq_layers = {(slot.path, slot.layer): leaf for slot, leaf in leaves if isinstance(slot.layer, int)}
    planned = []
    for spec in specs:
        for layer in range(num_layers) if spec.per_layer else [None]:
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
            sizes = [axis_sizes(leaf) for leaf, _ in parts]
            out_dtype = dtype or np.dtype(parts[0][0].dtype)
            nbytes = math.prod(hf_shape(spec, sizes)) * out_dtype.itemsize
            for entry in spec.entries(sizes[0]):  # one HF tensor per entry of a split axis (Mixtral's experts)
                make = _maker(spec, parts, layer, out_dtype, entry)
                planned.append(PlannedTensor(spec.key_for(layer, entry), nbytes, make))
    return planned


def _maker(spec: HfTensor, parts: list[tuple[NamedArray, bool]], layer: int | None, dtype: np.dtype, entry=None):
    def make() -> np.ndarray:
        arrays = [np.asarray(jax.device_get(leaf.array[layer] if stacked else leaf.array)) for leaf, stacked in parts]
        names = [axis_names(leaf) for leaf, _ in parts]
        if entry is not None:
            arrays = [np.take(a, entry, axis=n.index(spec.split_axis)) for a, n in zip(arrays, names, strict=True)]
            names = [[x for x in n if x != spec.split_axis] for n in names]
        return ours_to_hf(spec, [a.astype(dtype, copy=False) for a in arrays], names)

    return make


def _write_json(path: Path, content: Any) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
