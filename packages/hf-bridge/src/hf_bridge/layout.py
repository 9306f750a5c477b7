"""How one Hugging Face tensor is laid out in terms of our named axes, and conversion of its data both ways.

An HF tensor is described by the parameters of ours that it holds (`Part`s, concatenated along one dimension
when several are fused, like GPT-2's c_attn) and, for each part, the HF dimensions as groups of our axis
names: a group of several names is flattened row-major into one HF dimension, e.g. ("heads", "head_size").

One parameter of ours may also be spread over several HF tensors, one per entry of one of its axes (Mixtral's
experts, stored as `experts.{expert}.w1.weight`): the HfTensor's `split_axis` names that axis of ours, its key
holds "{expert}", and its layout describes one entry (without the split axis).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import HfBridgeError

AxisGroup = str | tuple[str, ...]
LAYER = "{layer}"
EXPERT = "{expert}"


@dataclass(frozen=True)
class Part:
    """One parameter of ours inside an HF tensor: its path and the HF dimensions in our axis names."""

    path: str
    layout: tuple[AxisGroup, ...]

    def names(self) -> tuple[str, ...]:
        """Our axis names in HF's (flattened, row-major) order."""
        return tuple(n for group in self.layout for n in _group(group))


@dataclass(frozen=True)
class HfTensor:
    """An HF checkpoint key (with "{layer}" for per-layer tensors) and the parts of ours it holds."""

    key: str
    parts: tuple[Part, ...]
    concat_dim: int = 0
    # Our axis whose entries are separate HF tensors (the key's "{expert}"), or None.
    split_axis: str | None = None

    @property
    def per_layer(self) -> bool:
        return LAYER in self.key

    def key_for(self, layer: int | None, entry: int | None = None) -> str:
        """The concrete key of this tensor for one layer (and entry of the split axis), or the key itself."""
        key = self.key.replace(LAYER, str(layer)) if self.per_layer else self.key
        return key.replace(EXPERT, str(entry)) if self.split_axis is not None else key

    def entries(self, sizes: dict[str, int]) -> list[int | None]:
        """The entries of the split axis (given our axis sizes): one HF tensor each; [None] without a split."""
        return [None] if self.split_axis is None else list(range(sizes[self.split_axis]))


def tensor(key: str, path: str, *layout: AxisGroup) -> HfTensor:
    """An HF tensor holding exactly one parameter of ours."""
    return HfTensor(key, (Part(path, tuple(layout)),))


def split(key: str, path: str, axis: str, *layout: AxisGroup) -> HfTensor:
    """One parameter of ours stored as one HF tensor per entry of its axis `axis` (the key holds "{expert}")."""
    return HfTensor(key, (Part(path, tuple(layout)),), split_axis=axis)


def fused(key: str, concat_dim: int, *parts: tuple[str, tuple[AxisGroup, ...]]) -> HfTensor:
    """An HF tensor holding several parameters of ours, concatenated along `concat_dim`."""
    return HfTensor(key, tuple(Part(path, tuple(layout)) for path, layout in parts), concat_dim)


def _group(group: AxisGroup) -> tuple[str, ...]:
    return (group,) if isinstance(group, str) else tuple(group)


def part_hf_shape(part: Part, sizes: dict[str, int]) -> tuple[int, ...]:
    """The HF shape of one part, given the size of each of our axes."""
    return tuple(math.prod(sizes[n] for n in _group(g)) for g in part.layout)


def hf_shape(spec: HfTensor, part_sizes: Sequence[dict[str, int]]) -> tuple[int, ...]:
    """The HF shape of the whole tensor: the parts' shapes, summed along the concat dimension."""
    shapes = [part_hf_shape(p, s) for p, s in zip(spec.parts, part_sizes, strict=True)]
    shape = list(shapes[0])
    shape[spec.concat_dim] = sum(s[spec.concat_dim] for s in shapes)
    return tuple(shape)


def ours_to_hf(spec: HfTensor, arrays: Sequence[np.ndarray], axes: Sequence[Sequence[str]]) -> np.ndarray:
    """The HF tensor made from our arrays (one per part, each with its axis names in `axes`)."""
    pieces = []
    for part, array, names in zip(spec.parts, arrays, axes, strict=True):
        order = [list(names).index(n) for n in part.names()]
        sizes = dict(zip(names, array.shape, strict=True))
        pieces.append(np.transpose(array, order).reshape(part_hf_shape(part, sizes)))
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=spec.concat_dim)


def hf_to_ours(
    spec: HfTensor,
    index: int,
    hf: np.ndarray,
    axes: Sequence[str],
    part_sizes: Sequence[dict[str, int]],
    *,
    key: str,
    truncatable: frozenset[str] = frozenset(),
) -> np.ndarray:
    """Part `index` of an HF tensor, in our axis order `axes`; checks the HF shape and names `key` if wrong.

    A dimension that is exactly one axis in `truncatable` (e.g. GPT-2's learned `position` table) may be longer
    in the checkpoint than ours: its first rows are kept.
    """
    expected = hf_shape(spec, part_sizes)
    hf = _truncated(spec, hf, expected, truncatable)
    if tuple(hf.shape) != expected:
        raise HfBridgeError(
            f"Checkpoint tensor {key!r} has shape {tuple(hf.shape)} but the model config needs {expected} "
            f"(layout {[_group(g) for g in spec.parts[0].layout]}). The checkpoint does not match its config.json "
            "(or the config you gave): check hidden size, heads, layers, vocabulary and sequence length."
        )
    if len(spec.parts) > 1:
        widths = [part_hf_shape(p, s)[spec.concat_dim] for p, s in zip(spec.parts, part_sizes, strict=True)]
        start = sum(widths[:index])
        hf = np.take(hf, np.arange(start, start + widths[index]), axis=spec.concat_dim)
    part = spec.parts[index]
    sizes = part_sizes[index]
    names = part.names()
    unflattened = hf.reshape(tuple(sizes[n] for n in names))
    return np.transpose(unflattened, [names.index(n) for n in axes])


def _truncated(spec: HfTensor, hf: np.ndarray, expected: tuple[int, ...], truncatable: frozenset[str]) -> np.ndarray:
    if len(spec.parts) != 1 or hf.ndim != len(expected):
        return hf
    for dim, group in enumerate(spec.parts[0].layout):
        if group in truncatable and hf.shape[dim] > expected[dim]:
            hf = np.take(hf, np.arange(expected[dim]), axis=dim)
    return hf
