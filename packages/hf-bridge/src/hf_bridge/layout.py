"""Conversion of one Hugging Face tensor's data both ways, by its layout in our named axes.

The layouts themselves (HfTensor, Part) are plain data in lm_models.hf_layout, stated by each family's module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lm_models.hf_layout import HfTensor, Part, group_names

from .errors import HfBridgeError


def part_hf_shape(part: Part, sizes: dict[str, int]) -> tuple[int, ...]:
    """The HF shape of one part, given the size of each of our axes."""
    return tuple(math.prod(sizes[n] for n in group_names(g)) for g in part.layout)


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
    if spec.interleave:
        return hf[(slice(None),) * spec.concat_dim + (slice(index, None, len(spec.parts)),)]
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
            f"(layout {[group_names(g) for g in spec.parts[0].layout]}). The checkpoint does not match its config.json "
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
        group = group_names(self.part.layout[0])
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
        if self.spec.interleave:
            parts = len(self.spec.parts)
            block = block[(slice(None),) * self.spec.concat_dim + (slice(self.index, None, parts),)]
        elif self.spec.concat_dim != 0:
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
