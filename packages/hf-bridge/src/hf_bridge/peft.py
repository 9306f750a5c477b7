"""PEFT LoRA adapters: adapter_config.json + adapter_model.safetensors that `peft.PeftModel` loads, and back.

Our LoRA (named_tensors.nn.LoraLinear) adapts a Linear with A over (lora_rank, *In) and B over
(*Out, lora_rank); PEFT stores, per Hugging Face module, `lora_A.weight` (r, in_features) and
`lora_B.weight` (out_features, r) under `base_model.model.<module>`. The family's tensor table says which
HF module holds which of our Linears and how their axes flatten, so the conversion needs no hand-written
names. A fused HF weight (GPT-2's `c_attn` holds q, k and v) gets one adapter whose A stacks the parts' A
and whose B is block-diagonal: the same update, at rank r per adapted part, with PEFT's `rank_pattern` and
`alpha_pattern` keeping the scale alpha / r.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lm_models import LmConfig
from lm_models.hf_layout import LAYER, HfTensor, Part, group_names
from named_tensors import Axis, NamedArray
from named_tensors.nn import LORA_RANK, Linear, LoraLinear

from .errors import HfBridgeError
from .layout import part_hf_shape
from .mapping import family_for_ours
from .output_dir import OutputDir
from .params import LAYERS, STACKED, slot_of
from .st_format import build_header, layout, parse_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


@dataclass(frozen=True)
class HfLinear:
    """One HF module holding Linear weights of ours: its name (with {layer}), its weight tensor, our modules."""

    name: str
    weight: HfTensor
    ours: tuple[str, ...]  # our module paths within a block (or the model), one per part


def hf_linears(config: LmConfig) -> list[HfLinear]:
    """The HF modules whose `.weight` holds our Linear weights, from the family's tensor table."""
    out = []
    for spec in family_for_ours(config.model_type).tensors(config):
        if spec.duplicate:  # a copy of a weight another tensor holds (DeepSeek-V3's MTP head) is no module of its own
            continue
        if spec.key.endswith(".weight") and all(p.path.endswith(".weight") and len(p.layout) == 2 for p in spec.parts):
            ours = tuple(p.path[: -len(".weight")] for p in spec.parts)
            out.append(HfLinear(spec.key.removesuffix(".weight"), spec, ours))
    return out


def hf_lora_targets(config: LmConfig, target_modules: str | Sequence[str]) -> str | list[str]:
    """target_modules with Hugging Face module names (q_proj, c_attn, mlp.c_proj, ...) turned into ours.

    A name that is an HF module's name or its dotted suffix becomes our Linear(s) in that module (GPT-2's
    c_attn: q_proj, k_proj and v_proj); other names, and a regular expression, are kept (our own names).
    """
    if isinstance(target_modules, str):
        return target_modules
    modules = hf_linears(config)
    out: list[str] = []
    for name in target_modules:
        found = [m for m in modules if m.name == name or m.name.endswith("." + name)]
        for ours in [o for m in found for o in m.ours] or [name]:
            if ours not in out:
                out.append(ours)
    return out


def _to_hf(part: Part, array: np.ndarray, names: Sequence[str]) -> np.ndarray:
    """Our array (axes `names`) in the part's HF layout (groups of our axes flattened row-major)."""
    order = [list(names).index(n) for n in part.names()]
    sizes = dict(zip(names, array.shape, strict=True))
    return np.transpose(array, order).reshape(part_hf_shape(part, sizes))


def _from_hf(part: Part, hf: np.ndarray, names: Sequence[str], sizes: dict[str, int]) -> np.ndarray:
    """An HF-layout array of the part as ours, axes in `names` order."""
    unflat = np.ascontiguousarray(hf).reshape(tuple(sizes[n] for n in part.names()))
    return np.ascontiguousarray(np.transpose(unflat, [part.names().index(n) for n in names]))


def _in_out(part: Part, linear: Linear) -> tuple[Any, Any, bool]:
    """The part's (in group, out group) of HF weight dims, and whether HF stores it as (in, out) (Conv1D)."""
    in_names = {a.name for a in linear.In}
    first, second = part.layout
    if set(group_names(first)) == in_names:
        return first, second, True
    return second, first, False


def _lora_layers(model: Any) -> list[tuple[str, Any, LoraLinear]]:
    """(our module path within a block or the model, its slot's layer, the LoraLinear) of every adapter."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, LoraLinear | Linear))
    out = []
    for path, leaf in flat:
        if isinstance(leaf, LoraLinear):
            slot = slot_of([*_path_names(path), "weight"])
            out.append((slot.path[: -len(".weight")], slot.layer, leaf))
    return out


def _layer_slice(x: NamedArray, layer: int | str | None, index: int) -> np.ndarray:
    array = np.asarray(jax.device_get(x.array[index] if layer == STACKED else x.array), np.float32)
    return array


def save_peft_adapter(
    model: Any,
    config: LmConfig,
    path: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
) -> None:
    """Write the model's LoRA adapters as a PEFT adapter directory (adapter_config.json + safetensors)."""
    adapters = _lora_layers(model)
    if not adapters:
        raise HfBridgeError("save_peft_adapter: the model has no LoRA adapters (nt.nn.apply_lora adds them).")
    ranks = {a.Rank.size for _, _, a in adapters}
    scales = {a.scale for _, _, a in adapters}
    dropouts = {a.dropout for _, _, a in adapters}
    if len(ranks) != 1 or len(scales) != 1 or len(dropouts) != 1:
        raise HfBridgeError(
            f"save_peft_adapter needs one rank, scale and dropout for every adapter, got ranks {sorted(ranks)}, "
            f"scales {sorted(scales)} and dropouts {sorted(dropouts)}."
        )
    (r,), (scale,), (dropout,) = ranks, scales, dropouts
    by_ours = {o: (m, i) for m in hf_linears(config) for i, o in enumerate(m.ours)}
    # HF module name -> {part index: (A (r, in), B (out, r))}
    blocks: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = defaultdict(dict)
    layouts: dict[str, bool] = {}
    for ours, layer, adapter in adapters:
        if ours not in by_ours:
            raise HfBridgeError(
                f"the adapter on {ours!r} has no Hugging Face module in the {config.model_type} layout, so PEFT "
                "cannot hold it; adapt another layer, or merge the adapters (named_tensors.nn.merge_lora) and "
                "export the full model."
            )
        module, index = by_ours[ours]
        part = module.weight.parts[index]
        in_group, out_group, conv1d = _in_out(part, adapter.base)
        a_part, b_part = Part(ours, (LORA_RANK, in_group)), Part(ours, (out_group, LORA_RANK))
        layers = range(config.num_layers) if layer == STACKED else [layer]
        for i in layers:
            name = module.name.replace(LAYER, str(i)) if module.weight.per_layer else module.name
            a_names = [n for n in adapter.lora_a.axis_names if n != LAYERS]
            b_names = [n for n in adapter.lora_b.axis_names if n != LAYERS]
            a = _to_hf(a_part, _layer_slice(adapter.lora_a, layer, i), a_names)
            b = _to_hf(b_part, _layer_slice(adapter.lora_b, layer, i), b_names)
            blocks[name][index] = (a, b)
            layouts[name] = conv1d
    if len(set(layouts.values())) > 1:
        raise HfBridgeError("the adapted modules mix Linear and Conv1D layouts, which one PEFT config cannot state.")
    parts_of = {m.name.replace(LAYER, str(i)): m for m in hf_linears(config) for i in range(config.num_layers)}
    tensors: dict[str, np.ndarray] = {}
    rank_pattern: dict[str, int] = {}
    for name, parts in blocks.items():
        a, b = _fused(parts_of[name], parts)
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b
        if a.shape[0] != r:
            rank_pattern[re.escape(name)] = int(a.shape[0])
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": scale * r,
        "lora_dropout": dropout,
        "target_modules": sorted(blocks),
        "bias": "none",
        "fan_in_fan_out": next(iter(layouts.values())),
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {k: scale * v for k, v in rank_pattern.items()},
    }
    entries = layout([(k, v.dtype, v.shape) for k, v in tensors.items()])
    data = build_header(entries, {"format": "pt"}) + b"".join(
        np.ascontiguousarray(tensors[e.key]).astype(e.numpy_dtype.newbyteorder("<"), copy=False).tobytes()
        for e in entries
    )
    out = OutputDir(path, overwrite).open()
    try:
        out.write_bytes(ADAPTER_WEIGHTS, data)
        out.write_bytes(ADAPTER_CONFIG, (json.dumps(adapter_config, indent=2) + "\n").encode("utf-8"))
        out.publish()
    except BaseException:
        out.discard()
        raise


def _fused(module: HfLinear, parts: dict[int, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One module's A and B from its adapted parts: A stacked, B block-diagonal (rows in the parts' order)."""
    if len(module.weight.parts) == 1:
        return parts[0]
    outs = []
    for index in range(len(module.weight.parts)):
        if index in parts:
            outs.append(parts[index][1].shape[0])
        else:
            raise HfBridgeError(
                f"{module.name} fuses {list(module.ours)}; adapt all of them (PEFT keeps one adapter for the fused "
                "weight), or merge the adapters and export the full model."
            )
    a = np.concatenate([parts[i][0] for i in sorted(parts)], axis=0)
    b = np.zeros((sum(outs), a.shape[0]), dtype=a.dtype)
    row = col = 0
    for i in sorted(parts):
        part_b = parts[i][1]
        b[row : row + part_b.shape[0], col : col + part_b.shape[1]] = part_b
        row, col = row + part_b.shape[0], col + part_b.shape[1]
    return a, b


def _read_config(directory: Path) -> dict[str, Any]:
    file = directory / ADAPTER_CONFIG
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HfBridgeError(f"{file} does not exist; a PEFT adapter directory needs it.") from None
    except json.JSONDecodeError as e:
        raise HfBridgeError(f"{file} is not valid JSON ({e}).") from None
    if config.get("peft_type") != "LORA":
        raise HfBridgeError(f"{file}: peft_type is {config.get('peft_type')!r}; hf_bridge reads LORA adapters only.")
    for key, wanted in (("use_dora", False), ("use_rslora", False), ("bias", "none")):
        if config.get(key, wanted) != wanted:
            raise HfBridgeError(f"{file}: {key}={config[key]!r} is not supported (only {key}={wanted!r}).")
    return config


def _scale_of(config: dict[str, Any], module: str) -> float:
    """PEFT's alpha / r for one module, with its rank_pattern and alpha_pattern (regex keys, suffix match)."""

    def lookup(pattern: dict[str, Any], default: Any) -> Any:
        for key, value in pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    r = lookup(config.get("rank_pattern") or {}, config["r"])
    return float(lookup(config.get("alpha_pattern") or {}, config["lora_alpha"])) / r


def load_peft_adapter(path: str | os.PathLike, model: Any, config: LmConfig | None = None) -> Any:
    """The model with LoRA adapters read from a PEFT adapter directory (as save_peft_adapter or peft writes it).

    Each adapted HF module's parts get A and B with the module's rank (a fused module's parts share its A and
    take their rows of B), so the loaded model computes what PEFT computes; scale is the adapter's alpha / r,
    module-specific patterns folded into B. Layers of a stack that the file does not adapt get zero adapters.
    """
    config = config or model.config
    if config is None:
        raise HfBridgeError("load_peft_adapter needs the model's LmConfig: pass config=, or a model that has .config.")
    directory = Path(os.fspath(path))
    adapter_config = _read_config(directory)
    base_scale = float(adapter_config["lora_alpha"]) / int(adapter_config["r"])
    names = {m.name.replace(LAYER, str(i)): (m, i if m.weight.per_layer else None)
             for m in hf_linears(config) for i in range(config.num_layers)}  # fmt: skip
    found: dict[tuple[str, int | None], dict[str, np.ndarray]] = defaultdict(dict)
    file = directory / ADAPTER_WEIGHTS
    if not file.is_file():
        raise HfBridgeError(f"{file} does not exist; a PEFT adapter directory needs it.")
    raw = file.read_bytes()
    header = parse_header(raw, len(raw), str(file))
    for entry in header.entries:
        match = _KEY.match(entry.key)
        if match is None or match["module"] not in names:
            raise HfBridgeError(
                f"{file} holds {entry.key!r}, which is not a LoRA weight of a {config.model_type} module hf_bridge "
                "knows; was the adapter made for another architecture?"
            )
        module, layer = names[match["module"]]
        begin, end = header.data_start + entry.begin, header.data_start + entry.end
        dtype = entry.numpy_dtype.newbyteorder("<")
        value = np.frombuffer(raw[begin:end], dtype=dtype).reshape(entry.shape).astype(np.float32)
        if match["which"] == "B":
            value = value * (_scale_of(adapter_config, match["module"]) / base_scale)
        found[(module.name, layer)][match["which"]] = value
    return _with_adapters(model, found, base_scale, float(adapter_config.get("lora_dropout", 0.0)))


def _check_shapes(module: HfLinear, found: dict[str, np.ndarray], in_width: int, min_rows: int) -> None:
    a, b = found.get("A"), found.get("B")
    if a is None or b is None:
        raise HfBridgeError(f"the adapter of {module.name} has only lora_{'A' if b is None else 'B'}; it needs both.")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_width or b.shape[0] < min_rows or a.shape[0] != b.shape[1]:
        raise HfBridgeError(
            f"the adapter of {module.name} has lora_A {a.shape} and lora_B {b.shape}, which do not fit the model "
            f"(in_features {in_width}); was it made for a model of another size?"
        )


def _path_names(path: tuple) -> list[str]:
    return [str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path]


def _with_adapters(model: Any, found: dict, scale: float, dropout: float) -> Any:
    """Wrap each Linear that `found` adapts (in any layer) in a LoraLinear holding the loaded A and B."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, Linear))
    linear_of = {}
    for path, leaf in flat:
        if isinstance(leaf, Linear):
            linear_of.setdefault(slot_of([*_path_names(path), "weight"]).path[: -len(".weight")], leaf)
    module_of = {o: (m, i) for m in hf_linears(model.config) for i, o in enumerate(m.ours)}

    def width(linear: Linear, group: Any) -> int:
        sizes = {a.name: a.size for a in (*linear.In, *linear.Out)}
        return int(np.prod([sizes[n] for n in group_names(group)]))

    def wrap(path: tuple, leaf: Any) -> Any:
        if not isinstance(leaf, Linear):
            return leaf
        slot = slot_of([*_path_names(path), "weight"])
        ours = slot.path[: -len(".weight")]
        if ours not in module_of:
            return leaf
        module, index = module_of[ours]
        layers = list(range(model.config.num_layers)) if slot.layer == STACKED else [slot.layer]
        per_layer = [found.get((module.name, layer)) for layer in layers]
        if all(p is None for p in per_layer):
            return leaf
        rank = max(p["A"].shape[0] for p in per_layer if p is not None)
        in_group, out_group, _ = _in_out(module.weight.parts[index], leaf)
        # This part's rows of a (fused) module's B: after the rows of the parts before it.
        row = sum(width(linear_of[o], _in_out(module.weight.parts[j], linear_of[o])[1]) for j, o in
                  enumerate(module.ours[:index]))  # fmt: skip
        rows = width(leaf, out_group)
        sizes = {a.name: a.size for a in (*leaf.In, *leaf.Out)} | {LORA_RANK: rank}
        a_part, b_part = Part(ours, (LORA_RANK, in_group)), Part(ours, (out_group, LORA_RANK))
        a_names = (LORA_RANK, *(a.name for a in leaf.In))
        b_names = (*(a.name for a in leaf.Out), LORA_RANK)
        a_list, b_list = [], []
        for p in per_layer:
            a_hf = np.zeros((rank, width(leaf, in_group)), np.float32)
            b_hf = np.zeros((rows, rank), np.float32)
            if p is not None:  # a smaller rank is padded with zeros: the same update
                _check_shapes(module, p, a_hf.shape[1], row + rows)
                a_hf[: p["A"].shape[0]] = p["A"]
                b_hf[:, : p["B"].shape[1]] = p["B"][row : row + rows]
            a_list.append(_from_hf(a_part, a_hf, a_names, sizes))
            b_list.append(_from_hf(b_part, b_hf, b_names, sizes))
        extra = tuple(a for a in leaf.weight.axes if a.name == LAYERS)
        Rank = Axis(LORA_RANK, rank)
        a = np.stack(a_list) if extra else a_list[0]
        b = np.stack(b_list) if extra else b_list[0]
        dtype = leaf.weight.dtype
        lora_a = NamedArray(jnp.asarray(a, dtype), (*extra, Rank, *leaf.In))
        lora_b = NamedArray(jnp.asarray(b, dtype), (*extra, *leaf.Out, Rank))
        return LoraLinear(leaf, lora_a, lora_b, None, scale, dropout)

    return jax.tree_util.tree_map_with_path(wrap, model, is_leaf=lambda x: isinstance(x, Linear))
