"""Our model's parameters by path: a model-level path, or a per-layer path with its layer (stacked or not)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax

import named_tensors as nt
from lm_models import LmConfig
from named_tensors import Axis, NamedArray

LAYERS = "layers"
STACKED = "stacked"


@dataclass(frozen=True)
class ParamSlot:
    """Where one NamedArray leaf sits: its path within the model or within one layer's block.

    `layer` is None for model-level parameters, an int for one block of an unrolled stack, or STACKED for a
    leaf of a scanned stack whose leading `layers` axis holds every layer.
    """

    path: str
    layer: int | str | None

    @property
    def stacked(self) -> bool:
        return self.layer == STACKED


def skeleton(config: LmConfig, Vocab: Axis) -> Any:
    """The model's structure with shapes and dtypes but no data (nothing is allocated)."""
    return eqx.filter_eval_shape(lambda: config.build(Vocab, key=jax.random.key(0)))


def _entry_name(entry: Any) -> str:
    for attr in ("name", "idx", "key"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def slot_of(names: list[str]) -> ParamSlot:
    """The slot of a leaf from its attribute path: [prefix.]blocks.stacked.X, [prefix.]blocks.blocks.N.X, or X.

    A per-layer path keeps the prefix of the module holding the stack (e.g. Backpack's "transformer.").
    """
    for i in range(len(names) - 1):
        if names[i] != "blocks":
            continue
        prefix = names[:i]
        if names[i + 1] == "stacked" and len(names) > i + 2:
            return ParamSlot(".".join(prefix + names[i + 2 :]), STACKED)
        if names[i + 1] == "blocks" and len(names) > i + 3:
            return ParamSlot(".".join(prefix + names[i + 3 :]), int(names[i + 2]))
    return ParamSlot(".".join(names), None)


def named_leaves(model: Any) -> tuple[list[tuple[ParamSlot, NamedArray]], Any]:
    """Every NamedArray leaf of the model with its slot, and the treedef to rebuild the model from leaves."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=nt.is_named)
    leaves = []
    for path, leaf in flat:
        if not isinstance(leaf, NamedArray):
            raise TypeError(f"Parameter {jax.tree_util.keystr(path)} is not a NamedArray; hf_bridge maps NamedArrays")
        leaves.append((slot_of([_entry_name(e) for e in path]), leaf))
    return leaves, treedef


def axis_sizes(leaf: NamedArray) -> dict[str, int]:
    """Axis name -> size of a leaf, without the stacked `layers` axis."""
    return {a.name: a.size for a in leaf.axes if a.name != LAYERS}


def axis_names(leaf: NamedArray) -> list[str]:
    """A leaf's axis names, without the stacked `layers` axis."""
    return [a.name for a in leaf.axes if a.name != LAYERS]
