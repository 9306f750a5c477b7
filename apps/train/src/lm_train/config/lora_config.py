"""The `lora` section: low-rank adapters on named linear layers, with Levanter's keys (r, alpha, dropout,
target_modules); only the adapters train, and only they are checkpointed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import draccus

from lm_train.errors import ConfigError

if TYPE_CHECKING:  # what the decoder below gives; draccus needs the class to register that decoder on
    ModuleNames = str | tuple[str, ...]
else:

    class ModuleNames:
        """The type of `lora.target_modules`: a list of layer names, or one regular expression (a string)."""


def _decode_module_names(raw: Any, path: Any = ()) -> str | tuple[str, ...]:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list | tuple) and all(isinstance(name, str) for name in raw):
        return tuple(raw)
    raise ValueError(f"give a list of layer names (e.g. [q_proj, v_proj]) or one regular expression, not {raw!r}")


draccus.decode.register(ModuleNames, _decode_module_names)


@dataclass(frozen=True)
class LoraSection:
    """LoRA on the base model of `initialize_from_hf`: y = W x + (alpha / r) B A x on each targeted Linear."""

    r: int = 8
    """Rank of each adapter (A: r x in, B: out x r)."""
    alpha: float = 8.0
    """Scale: the update is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    target_modules: ModuleNames | None = None
    """Layers to adapt: a list of names (Hugging Face's, e.g. [q_proj, v_proj], or ours), each matching a layer
    whose path ends with it, or one regex matching whole paths; None: every linear layer (Levanter's default)."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"lora.r must be a positive integer rank, e.g. 8; got {self.r!r}.")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be positive (the update is scaled by alpha / r); got {self.alpha!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1); got {self.dropout!r}.")
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError("lora.target_modules is empty; name layers (e.g. [q_proj, v_proj]) or leave it out.")


ALL_LINEAR = ".*"
"""The regex that target_modules: None stands for."""
