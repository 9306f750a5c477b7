"""Axis: a named dimension of a given size (no jax, so that configs can name their axes without it)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias


@dataclass(frozen=True)
class Axis:
    """A named dimension of a given size."""

    name: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Axis name must be a non-empty string, got {self.name!r}")
        if not _is_integer(self.size) or self.size < 0:
            raise TypeError(f"Axis {self.name!r} needs a non-negative int size, got {self.size!r}")
        object.__setattr__(self, "size", int(self.size))

    def alias(self, new_name: str) -> Axis:
        """The same size under another name."""
        return Axis(new_name, self.size)

    def resize(self, size: int) -> Axis:
        """The same name with another size."""
        return Axis(self.name, size)

    def __repr__(self) -> str:
        return f"Axis({self.name!r}, {self.size})"


AxisSelector: TypeAlias = Axis | str
AxisSelection: TypeAlias = AxisSelector | Sequence[AxisSelector]
AxisSpec: TypeAlias = Axis | Sequence[Axis]
Scalar: TypeAlias = int | float | bool | complex


def axis_name(axis: AxisSelector) -> str:
    """The name of an Axis or of a name."""
    if isinstance(axis, Axis):
        return axis.name
    if isinstance(axis, str):
        return axis
    raise TypeError(f"Expected an Axis or an axis name, got {axis!r}")


def _is_integer(value: object) -> bool:
    """An int or a numpy integer, never a bool; numpy is not imported for it (a numpy integer implies numpy is)."""
    if isinstance(value, bool):
        return False
    numpy = sys.modules.get("numpy")
    return isinstance(value, int) or (numpy is not None and isinstance(value, numpy.integer))
