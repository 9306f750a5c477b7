"""A family's Hugging Face checkpoint layout as plain data: tensor names, their layouts, and the family's mapping.

An HF tensor is described by the parameters of ours that it holds (`Part`s, concatenated along one dimension
when several are fused, like GPT-2's c_attn) and, for each part, the HF dimensions as groups of our axis
names: a group of several names is flattened row-major into one HF dimension, e.g. ("heads", "head_size").

One parameter of ours may also be spread over several HF tensors, one per entry of one of its axes (Mixtral's
experts, stored as `experts.{expert}.w1.weight`): the HfTensor's `split_axis` names that axis of ours, its key
holds "{expert}", and its layout describes one entry (without the split axis).

A per-layer tensor may exist in some layers only (Qwen3-MoE's experts in its sparse layers, the dense MLP in the
others): its `layers` lists them.

Reading and writing the data (safetensors, numpy) is hf_bridge's job; this module only describes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

AxisGroup = str | tuple[str, ...]
LAYER = "{layer}"
EXPERT = "{expert}"


def group_names(group: AxisGroup) -> tuple[str, ...]:
    """The axis names of one HF dimension (a single name, or several flattened row-major)."""
    return (group,) if isinstance(group, str) else tuple(group)


@dataclass(frozen=True)
class Part:
    """One parameter of ours inside an HF tensor: its path and the HF dimensions in our axis names."""

    path: str
    layout: tuple[AxisGroup, ...]

    def names(self) -> tuple[str, ...]:
        """Our axis names in HF's (flattened, row-major) order."""
        return tuple(n for group in self.layout for n in group_names(group))


@dataclass(frozen=True)
class HfTensor:
    """An HF checkpoint key (with "{layer}" for per-layer tensors) and the parts of ours it holds."""

    key: str
    parts: tuple[Part, ...]
    concat_dim: int = 0
    # Our axis whose entries are separate HF tensors (the key's "{expert}"), or None.
    split_axis: str | None = None
    # The layers that hold this per-layer tensor; None: every layer.
    layers: tuple[int, ...] | None = None
    # Fused parts interleaved along concat_dim (entry j of part i at j * len(parts) + i, gpt-oss's gate_up_proj)
    # rather than one after the other.
    interleave: bool = False
    # A second copy of a parameter that another tensor holds (DeepSeek-V3's MTP modules repeat the embedding and
    # the head): written on export; on load accepted when present, never required, never read.
    duplicate: bool = False
    # The fix that a load names when a checkpoint lacks this tensor (modules that checkpoints may leave out).
    missing_hint: str = ""

    def __post_init__(self) -> None:
        if self.interleave and self.concat_dim == 0:
            raise ValueError(f"{self.key}: parts can be interleaved along a dimension after the first only")

    @property
    def per_layer(self) -> bool:
        return LAYER in self.key

    def layer_list(self, num_layers: int) -> list[int | None]:
        """The layers this tensor has a key for, of num_layers; [None] for a model-level tensor."""
        if not self.per_layer:
            return [None]
        return list(range(num_layers)) if self.layers is None else list(self.layers)

    def key_for(self, layer: int | None, entry: int | None = None) -> str:
        """The concrete key of this tensor for one layer (and entry of the split axis), or the key itself."""
        key = self.key.replace(LAYER, str(layer)) if self.per_layer else self.key
        return key.replace(EXPERT, str(entry)) if self.split_axis is not None else key

    def entries(self, sizes: dict[str, int]) -> list[int | None]:
        """The entries of the split axis (given our axis sizes): one HF tensor each; [None] without a split."""
        return [None] if self.split_axis is None else list(range(sizes[self.split_axis]))


def tensor(key: str, path: str, *layout: AxisGroup, layers: tuple[int, ...] | None = None) -> HfTensor:
    """An HF tensor holding exactly one parameter of ours (in `layers` only, when given)."""
    return HfTensor(key, (Part(path, tuple(layout)),), layers=layers)


def split(key: str, path: str, axis: str, *layout: AxisGroup, layers: tuple[int, ...] | None = None) -> HfTensor:
    """One parameter of ours stored as one HF tensor per entry of its axis `axis` (the key holds "{expert}")."""
    return HfTensor(key, (Part(path, tuple(layout)),), split_axis=axis, layers=layers)


def fused(key: str, concat_dim: int, *parts: tuple[str, tuple[AxisGroup, ...]], interleave: bool = False) -> HfTensor:
    """An HF tensor holding several parameters of ours, concatenated (or interleaved) along `concat_dim`."""
    return HfTensor(key, tuple(Part(path, tuple(layout)) for path, layout in parts), concat_dim, interleave=interleave)


@dataclass(frozen=True)
class HfWrapper:
    """An outer Hugging Face model that holds the family's model inside it (Llama 4's multimodal `llama4` around
    its `llama4_text`): its config.json nests the family's under `config_key`, its checkpoint holds the family's
    tensors under `weight_prefix` and tensors of other parts (a vision tower) under `left_out`; the import reads
    the family's model alone and logs `note`."""

    model_type: str
    config_key: str
    weight_prefix: str
    left_out: tuple[str, ...]
    # The outer config.json's own keys that belong to the parts left out (read and not used).
    ignored_keys: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class HfMapping:
    """How one family maps to Hugging Face: its names there, config.json both ways, and the tensor layout.

    A config class holds its mapping as the class variable `hf_mapping`; hf_bridge finds it through the
    LmConfig registry, so a new family needs no change in hf_bridge.
    """

    hf_model_type: str
    architecture: str
    # HF config.json (a dict) and where it came from -> keyword arguments of our config class.
    config_from_hf: Callable[[Mapping[str, Any], str], dict[str, Any]]
    # Our config and the vocabulary size -> the family's config.json keys.
    config_to_hf: Callable[[Any, int], dict[str, Any]]
    # Our config -> every HF tensor of the checkpoint.
    tensors: Callable[[Any], list[HfTensor]]
    # The base-model prefix that some checkpoints leave out of their keys (e.g. "transformer.").
    base_prefix: str = ""
    # Checkpoint keys (suffixes) that are buffers, not weights, and are skipped on load.
    ignored_suffixes: tuple[str, ...] = ()
    # Our axes whose HF dimension may be longer than ours (its first entries are loaded).
    truncatable: frozenset[str] = frozenset()
    # (our config, checkpoint key) -> whether the config leaves that tensor out (DeepSeek-V3's MTP modules beyond
    # mtp_depth): such tensors are skipped on load, with a log line, rather than refused as unknown.
    unused: Callable[[Any, str], bool] | None = None
    # Outer models whose checkpoints hold this family's model (imported from, never exported to).
    wrappers: tuple[HfWrapper, ...] = ()
