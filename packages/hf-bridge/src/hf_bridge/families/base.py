"""Family: what hf_bridge knows about one model family (config mapping both ways and the tensor layout)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lm_models import LmConfig

from ..layout import HfTensor


@dataclass(frozen=True)
class Family:
    """One model family: HF's names for it, config conversion both ways and the HF tensor layout."""

    hf_model_type: str
    our_type: str
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

    def config_class(self) -> type[LmConfig]:
        return LmConfig.get_choice_class(self.our_type)
