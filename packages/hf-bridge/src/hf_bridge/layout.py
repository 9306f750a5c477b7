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


def hf_view_as_ours(part: Part, region: np.ndarray, names: Sequence[str], sizes: dict[str, int]) -> np.ndarray:
    """A view of the region of an HF tensor that holds one part, with our axes in `names` order.

    Writing into the view fills the HF tensor in HF's layout; nothing is copied (splitting a dimension in two,
    and transposing, are always views).
    """
    unflat = region.reshape(tuple(sizes[n] for n in part.names()))
    if unflat.base is None and region.size > 1:
        raise AssertionError("reshaping an HF region made a copy")  # cannot happen: only dimensions are split
    order = part.names()
    return unflat.transpose([order.index(n) for n in names])


def part_region(spec: HfTensor, index: int, hf: np.ndarray, part_sizes: Sequence[dict[str, int]]) -> np.ndarray:
    """The view of an HF tensor (ours, being made) that part `index` fills."""
    if len(spec.parts) == 1:
        return hf
    widths = [part_hf_shape(p, s)[spec.concat_dim] for p, s in zip(spec.parts, part_sizes, strict=True)]
    start = sum(widths[:index])
    return hf[(slice(None),) * spec.concat_dim + (slice(start, start + widths[index]),)]


def check_hf_shape(
    spec: HfTensor, actual: Sequence[int], part_sizes: Sequence[dict[str, int]], key: str, truncatable: frozenset[str]
) -> None:
    """Raise, naming `key`, unless a checkpoint tensor's shape is what the config needs.

    A dimension that is exactly one axis in `truncatable` (e.g. GPT-2's learned `position` table) may be longer
    in the checkpoint than ours: its first rows are loaded.
    """
    expected = hf_shape(spec, part_sizes)
    actual = tuple(actual)
    ok = actual == expected
    if not ok and len(spec.parts) == 1 and len(actual) == len(expected):
        groups = spec.parts[0].layout
        ok = all(a == e or (g in truncatable and a > e) for a, e, g in zip(actual, expected, groups, strict=True))
    if not ok:
        raise HfBridgeError(
            f"Checkpoint tensor {key!r} has shape {actual} but the model config needs {expected} "
            f"(layout {[_group(g) for g in spec.parts[0].layout]}). The checkpoint does not match its config.json "
            "(or the config you gave): check hidden size, heads, layers, vocabulary and sequence length."
        )


Box = dict[str, tuple[int, int]]


@dataclass(frozen=True)
class PartReader:
    """Where a box of one part (a range of each of our axes) lies in a checkpoint tensor, and how to cut it out.

    Checkpoint tensors are read as ranges of rows (indices of their first dimension), which safetensors stores
    contiguously: `rows` gives the rows that hold a box, `cut` takes the box out of them in our axis order.
    """

    spec: HfTensor
    index: int
    part_sizes: tuple[dict[str, int], ...]
    actual: tuple[int, ...]

    @property
    def part(self) -> Part:
        return self.spec.parts[self.index]

    def _concat_start(self) -> int:
        widths = [
            part_hf_shape(p, s)[self.spec.concat_dim] for p, s in zip(self.spec.parts, self.part_sizes, strict=True)
        ]
        return sum(widths[: self.index])

    def _lead(self) -> tuple[str, int]:
        """The first of our axes in the first HF dimension, and how many rows one of its indices spans."""
        group = _group(self.part.layout[0])
        sizes = self.part_sizes[self.index]
        return group[0], math.prod(sizes[n] for n in group[1:])

    def rows(self, box: Box) -> tuple[int, int]:
        """The rows [start, stop) of the checkpoint tensor that hold `box`."""
        lead, span = self._lead()
        first, last = box[lead]
        offset = self._concat_start() if self.spec.concat_dim == 0 else 0
        return offset + first * span, offset + last * span

    def cut(self, rows: np.ndarray, first_row: int, box: Box, names: Sequence[str]) -> np.ndarray:
        """The box, in our axis order `names`, from rows of the checkpoint tensor starting at row `first_row`."""
        sizes = self.part_sizes[self.index]
        expected = part_hf_shape(self.part, sizes)
        start, stop = self.rows(box)
        block = rows[start - first_row : stop - first_row]
        if self.spec.concat_dim != 0:
            c = self._concat_start()
            block = block[(slice(None),) * self.spec.concat_dim + (slice(c, c + expected[self.spec.concat_dim]),)]
        # Longer (truncatable) dimensions after the first: keep their first entries.
        block = block[(slice(None), *(slice(0, n) for n in expected[1:]))]
        lead, _ = self._lead()
        order = self.part.names()
        shape = tuple(box[lead][1] - box[lead][0] if n == lead else sizes[n] for n in order)
        block = block.reshape(shape)
        block = block[tuple(slice(0, None) if n == lead else slice(*box[n]) for n in order)]
        return block.transpose([order.index(n) for n in names])
