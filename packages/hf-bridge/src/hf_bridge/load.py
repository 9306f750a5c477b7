"""Loading Hugging Face checkpoints into lm_models: a whole model with its config, or weights into a given one."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

import named_tensors as nt
from lm_models import HfMapping, HfTensor, HfWrapper, LmConfig
from named_tensors import Axis, NamedArray

from .config import hf_config_to_ours, vocab_size_of
from .errors import HfBridgeError
from .mapping import family_for_ours, unwrap
from .params import ParamSlot, axis_sizes, named_leaves, skeleton
from .reader import CONFIG_FILE, CheckpointReader, log, read_json
from .scatter import Member, read_parameters
from .sources import open_location

# Fields that do not change a model's weights or outputs: they may differ between a checkpoint and the config
# its weights are loaded into (mtp_depth only adds training depths, read when the checkpoint has them).
FREE_FIELDS = frozenset(
    {
        "seq_len", "gradient_checkpointing", "scan_layers", "scan_unroll", "use_flash_attention",
        "flash_attention_block_size", "initializer_range", "embed_pdrop", "resid_pdrop", "attn_pdrop", "upcast_attn",
        "lbl_coef", "rzl_coef", "moe_block_size", "attn_backend",
        "cross_entropy_block_size", "bias_update_speed", "mtp_depth", "mtp_loss_weight",
    }
)  # fmt: skip


FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def read_hf_config(path: str | os.PathLike, *, revision: str | None = None) -> dict[str, Any]:
    """The config.json of a checkpoint directory, fsspec URL or hub id, as a dict."""
    location = open_location(path, revision=revision)
    hf = read_json(location, CONFIG_FILE)
    if not isinstance(hf, dict):
        raise HfBridgeError(f"{location.where(CONFIG_FILE)} must hold a JSON object.")
    return hf


def read_model_config(
    path: str | os.PathLike,
    *,
    model_type: str | None = None,
    revision: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LmConfig:
    """Our model config built from a checkpoint's config.json (a directory, fsspec URL or hub id).

    For continuing from a Hugging Face model without copying its shapes by hand: `model_type` (our type name,
    e.g. "llama"), when given, must be the checkpoint's; `overrides` sets fields HF has no word for
    (gradient_checkpointing, scan_layers, flash attention, ...) or that may differ (seq_len).
    """
    location = open_location(path, revision=revision)
    hf = read_json(location, CONFIG_FILE)
    config = hf_config_to_ours(hf, where=location.where(CONFIG_FILE), **dict(overrides or {}))
    if model_type is not None and config.model_type != model_type:
        raise HfBridgeError(
            f"{location.where(CONFIG_FILE)} describes a {config.model_type} model, but the model section asks for "
            f"type {model_type!r}; set model.type to {config.model_type!r} or use a {model_type} checkpoint."
        )
    return config


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    revision: str | None = None,
    config_overrides: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    axis_mapping: Mapping[str, Any] | None = None,
) -> tuple[Any, LmConfig]:
    """A model and its config from an HF checkpoint (local directory, fsspec URL or hub id).

    `dtype` casts every parameter (default float32); `config_overrides` sets fields of our config that HF
    does not have (e.g. {"scan_layers": False, "gradient_checkpointing": "none"}); with a mesh and an axis
    mapping, each parameter is placed sharded by axis name as it is read, each process reading only the
    parts of the checkpoint that its devices hold.
    """
    location = open_location(path, revision=revision)
    # The weights' files are opened (and checked) first: a pickle gets its hint, not a config error.
    with CheckpointReader(location) as reader:
        where = location.where(CONFIG_FILE)
        hf = read_json(location, CONFIG_FILE)
        config = hf_config_to_ours(hf, where=where, **dict(config_overrides or {}))
        Vocab = Axis("vocab", vocab_size_of(hf, where))
        model = _fill(reader, skeleton(config, Vocab), config, dtype, mesh, axis_mapping, unwrap(hf, where)[2])
    return model, config


def load_weights(
    path: str | os.PathLike,
    model_or_config: Any,
    Vocab: Axis | None = None,
    *,
    dtype: Any = None,
    revision: str | None = None,
    mesh: Mesh | None = None,
    axis_mapping: Mapping[str, Any] | None = None,
) -> Any:
    """A model of the given structure (a model, or a config and Vocab) with the weights of an HF checkpoint.

    The checkpoint's config.json must agree with the given config on every field that changes the weights or
    the outputs; fields such as seq_len, dropout, scan_layers or gradient_checkpointing may differ (GPT-2's
    position table is cut to seq_len when the checkpoint's is longer). Leaves of the given model that are
    sharded arrays (or ShapeDtypeStructs with a sharding) keep their shardings.
    """
    if isinstance(model_or_config, LmConfig):
        if Vocab is None:
            raise HfBridgeError("load_weights(path, config, Vocab) needs the Vocab axis when given a config.")
        config, target = model_or_config, skeleton(model_or_config, Vocab)
    elif isinstance(getattr(model_or_config, "config", None), LmConfig):
        config, target = model_or_config.config, model_or_config
        Vocab = model_or_config.Vocab
    else:
        raise HfBridgeError(f"load_weights needs an lm_models config or model, got {type(model_or_config).__name__}.")
    location = open_location(path, revision=revision)
    with CheckpointReader(location) as reader:
        where = location.where(CONFIG_FILE)
        hf = read_json(location, CONFIG_FILE)
        check_compatible(hf_config_to_ours(hf, where=where), config, where)
        return _fill(reader, target, config, dtype, mesh, axis_mapping, unwrap(hf, where)[2])


def check_compatible(
    checkpoint: LmConfig, ours: LmConfig, where: str, also: tuple[str, ...] = (), other: str = "the model config"
) -> None:
    """Raise unless two configs agree on every field that changes the weights or the outputs (and on `also`)."""
    if type(checkpoint) is not type(ours):
        raise HfBridgeError(
            f"{where} describes a {checkpoint.model_type} model, but the weights are to be loaded into a "
            f"{ours.model_type} model; use a matching checkpoint or model type."
        )
    for field in dataclasses.fields(ours):  # pyright: ignore[reportArgumentType] (every registered family config is a dataclass)
        if field.name in FREE_FIELDS and field.name not in also:
            continue
        theirs, mine = getattr(checkpoint, field.name), getattr(ours, field.name)
        if theirs != mine:
            raise HfBridgeError(
                f"{where} gives {field.name}={theirs!r} but {other} has {field.name}={mine!r}; the weights "
                f"would not mean the same thing. Make {other} match."
            )


def float_dtype(dtype: Any, where: str) -> np.dtype:
    """The numpy dtype of a floating-point `dtype` argument (a name, numpy or jax dtype); errors otherwise."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in FLOAT_NAMES:
        raise HfBridgeError(f"{where}: dtype={dtype!r} is not a floating-point type; use one of {list(FLOAT_NAMES)}.")
    return resolved


def _fill(
    reader: CheckpointReader,
    target: Any,
    config: LmConfig,
    dtype: Any,
    mesh: Mesh | None,
    axis_mapping: Mapping[str, Any] | None,
    wrapper: HfWrapper | None = None,
) -> Any:
    """The target's structure with every NamedArray leaf read from the checkpoint, one leaf at a time (the family's
    tensors under the wrapper's prefix, when an outer model holds them)."""
    if (mesh is None) != (axis_mapping is None):
        raise HfBridgeError("Pass both mesh and axis_mapping to load sharded, or neither.")
    cast_to = None if dtype is None else float_dtype(dtype, "load")
    family = family_for_ours(config.model_type)
    specs = family.tensors(config)
    leaves, treedef = named_leaves(target)
    by_path = {(slot.path, slot.layer is not None): leaf for slot, leaf in leaves}
    owner = _owners(specs)
    split_sizes = {spec.key: axis_sizes(by_path[(spec.parts[0].path, spec.per_layer)]) for spec in specs}
    rename = _check_keys(reader, family, config, specs, split_sizes, wrapper)
    # The parameters that one checkpoint tensor holds (q, k and v in GPT-2's fused c_attn) are read together,
    # so that each tensor is read once.
    groups: dict[tuple[str, Any], list[tuple[int, ParamSlot, NamedArray]]] = {}
    for position, (slot, leaf) in enumerate(leaves):
        spec, _ = _owner_of(owner, slot)
        groups.setdefault((spec.key, slot.layer), []).append((position, slot, leaf))
    arrays: list[NamedArray | None] = [None] * len(leaves)
    for members in groups.values():
        slot = members[0][1]
        spec, _ = _owner_of(owner, slot)
        part_sizes = [axis_sizes(by_path[(p.path, spec.per_layer)]) for p in spec.parts]
        layers = list(range(config.num_layers)) if slot.stacked else None
        key_of = _key_of(rename, spec, slot.layer if isinstance(slot.layer, int) else None)  # STACKED: none
        plan = [
            Member(
                _owner_of(owner, s)[1],
                leaf,
                _sharding(leaf, mesh, axis_mapping),
                cast_to if cast_to is not None else np.dtype(leaf.dtype),
            )
            for _, s, leaf in members
        ]
        read = read_parameters(reader, key_of, spec, part_sizes, plan, layers, family.truncatable)
        for (position, _, leaf), array in zip(members, read, strict=True):
            arrays[position] = NamedArray(array, leaf.axes)
    total = sum(e.end - e.begin for e in reader.entries.values())
    log.info("read %d of the %d bytes of tensor data in %s", reader.bytes_read, total, reader.directory)
    return jax.tree_util.tree_unflatten(treedef, arrays)


def _key_of(rename: Callable[[str], str], spec: HfTensor, fixed_layer: int | None) -> Callable[..., str]:
    """(layer, entry) -> checkpoint key; a parameter of one layer (not stacked) always reads `fixed_layer`."""

    def key_of(layer: int | None, entry: int | None) -> str:
        return rename(spec.key_for(layer if layer is not None else fixed_layer, entry))

    return key_of


def _sharding(leaf: NamedArray, mesh: Mesh | None, axis_mapping: Any) -> jax.sharding.Sharding:
    """Sharded by axis name with a mesh and mapping, else like the target leaf, else on the first device."""
    if mesh is not None:
        return NamedSharding(mesh, nt.partition_spec(leaf.axes, axis_mapping, mesh))
    # A real array in the target (load_weights into an existing model) keeps its sharding.
    sharding = getattr(leaf.array, "sharding", None)
    return sharding if sharding is not None else SingleDeviceSharding(jax.local_devices()[0])


def _owners(specs: list[HfTensor]) -> dict[tuple[str, bool], tuple[HfTensor, int]]:
    owners = {}
    for spec in specs:
        if spec.duplicate:  # a copy of a parameter that another tensor holds is not read
            continue
        for index, part in enumerate(spec.parts):
            owners[(part.path, spec.per_layer)] = (spec, index)
    return owners


def _owner_of(owner: dict, slot: ParamSlot) -> tuple[HfTensor, int]:
    try:
        return owner[(slot.path, slot.layer is not None)]
    except KeyError:
        raise HfBridgeError(
            f"hf_bridge has no Hugging Face tensor for the parameter {slot.path!r}; lm_models and hf_bridge are "
            "out of step (please report this)."
        ) from None


def _check_keys(
    reader: CheckpointReader,
    family: HfMapping,
    config: LmConfig,
    specs: list[HfTensor],
    split_sizes: dict,
    wrapper: HfWrapper | None,
):
    """Check the checkpoint has every key we need, nothing unknown, and floats only; returns the key renamer."""
    expected = [
        (spec.key_for(layer, entry), spec)
        for spec in specs
        for layer in spec.layer_list(config.num_layers)
        for entry in spec.entries(split_sizes[spec.key])
    ]
    available = set(reader.keys())
    prefix = family.base_prefix
    outer = wrapper.weight_prefix if wrapper is not None else ""
    if wrapper is not None:
        left_out = {k for k in available if k.startswith(wrapper.left_out)}
        log.info("left out %d tensors of %s: %s", len(left_out), reader.directory, wrapper.note)
        available -= left_out
    # Checkpoints of the base model (and some old ones) leave out the prefix, e.g. GPT-2's "transformer.".
    strip = bool(prefix) and not any(k.startswith(outer + prefix) for k in available)

    def rename(key: str) -> str:
        return outer + (key[len(prefix) :] if strip and key.startswith(prefix) else key)

    wanted = [(rename(k), spec) for k, spec in expected]
    missing = [(k, spec) for k, spec in wanted if k not in available and not spec.duplicate]
    if missing:
        key, spec = missing[0]
        fix = f": {spec.missing_hint}." if spec.missing_hint else "; the weights and config.json do not match."
        raise HfBridgeError(
            f"The checkpoint in {reader.directory} has no tensor {key!r} ({len(missing)} missing), which a "
            f"{family.architecture} with this config.json needs{fix}"
        )
    wanted_set = {k for k, _ in wanted}
    extra = sorted(k for k in available - wanted_set if not k.endswith(family.ignored_suffixes))
    skipped = [k for k in extra if family.unused is not None and family.unused(config, k)]
    skipped_set = set(skipped)
    if skipped:
        log.info("skipped %d tensors of %s that this config leaves out, such as %s", len(skipped), reader.directory,
                 skipped[0])  # fmt: skip
    unknown = [k for k in extra if k not in skipped_set]
    if unknown:
        raise HfBridgeError(
            f"The checkpoint tensor {unknown[0]!r} in {reader.where(unknown[0])} is not part of a "
            f"{family.architecture} with this config.json ({len(unknown)} such tensors); the checkpoint holds "
            "another architecture or a config.json that does not match it."
        )
    for key, spec in wanted:
        if not spec.duplicate:
            reader.check_float(key)
    return rename


__all__ = ["check_compatible", "load_pretrained", "load_weights", "read_hf_config", "read_model_config"]
