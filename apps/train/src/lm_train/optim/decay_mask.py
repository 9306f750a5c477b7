"""Which parameters get weight decay: matrices by default, or those whose path matches given patterns."""

from __future__ import annotations

import re
from typing import Any

import jax

import named_tensors as nt

# Axes that mark embedding tables: no weight decay by default (as in GPT-2 and most LLM recipes).
_EMBEDDING_AXES = frozenset({"vocab", "position"})


def default_decay(param: Any) -> bool:
    """Decay matrices; not norms, biases (1-d parameters) or embedding tables."""
    if isinstance(param, nt.NamedArray):
        names = set(param.axis_names) - {"layers"}
        return len(names) >= 2 and not (names & _EMBEDDING_AXES)
    return getattr(param, "ndim", 0) >= 2


def weight_decay_mask(params: Any, patterns: tuple[str, ...] | None = None) -> Any:
    """A tree of bools, one per parameter (NamedArrays counted whole): which parameters get weight decay."""
    compiled = [re.compile(p) for p in patterns] if patterns is not None else None

    def decide(path: tuple, leaf: Any) -> bool:
        if leaf is None:
            return False
        if compiled is not None:
            text = nt.path_str(path)
            return any(p.search(text) for p in compiled)
        return default_decay(leaf)

    return jax.tree_util.tree_map_with_path(decide, params, is_leaf=nt.is_named)
