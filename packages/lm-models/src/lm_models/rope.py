"""RopeConfig: rotary position embedding settings (theta and an optional frequency scaling: linear, llama3,
dynamic NTK or YaRN)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from named_tensors.nn import RotaryEmbeddings

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embeddings: `type` default (plain), linear (positions / factor), llama3 (per-band scaling), dynamic
    (NTK: theta grows past original_max_position_embeddings) or yarn.

    The keys match Levanter's and Hugging Face's `rope_scaling`: `factor`, `low_freq_factor` and
    `high_freq_factor` (llama3), `original_max_position_embeddings` (llama3 and yarn; for dynamic, Hugging Face's
    `max_position_embeddings`, where the scaling starts), and `beta_fast`, `beta_slow`, `attention_factor`,
    `mscale`, `mscale_all_dim`, `truncate` (yarn).
    """

    type: str = "default"
    """Frequency scaling: default (none), linear, llama3, dynamic (NTK) or yarn."""
    theta: float = 10000.0
    """Base of the rotary frequencies: pair i of a head rotates by position * theta ** (-2i / head size)."""
    factor: float = 1.0
    """Context extension factor of linear, llama3, dynamic and yarn scaling (1: no extension)."""
    low_freq_factor: float = 1.0
    """llama3: frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor are divided
    by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: frequencies whose wavelength is below original_max_position_embeddings / high_freq_factor are kept
    (between the two bands, a smooth blend)."""
    original_max_position_embeddings: int = 8192
    """The context length the model was trained at, in positions: where llama3/yarn scaling bands and dynamic
    NTK scaling start."""
    beta_fast: float = 32.0
    """yarn: frequencies that turn more than this many times over the original context are kept unscaled."""
    beta_slow: float = 1.0
    """yarn: frequencies that turn fewer than this many times over the original context are divided by factor."""
    attention_factor: float | None = None
    """yarn: scale of the rotated queries and keys; null: derived from factor (or from mscale / mscale_all_dim)."""
    mscale: float | None = None
    """yarn: with mscale_all_dim, the attention factor is 0.1*mscale*ln(factor)+1 over the same with mscale_all_dim;
    null: unused."""
    mscale_all_dim: float | None = None
    """yarn: the denominator's mscale in the attention factor (see mscale); null: unused."""
    truncate: bool = True
    """yarn: round the interpolation ramp's ends to whole dimensions (floor and ceil)."""

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope.type={self.type!r} is not supported; use one of {list(ROPE_TYPES)}")
        if self.theta <= 0:
            raise ValueError(f"rope.theta must be positive, got {self.theta!r}")
        if self.factor <= 0:
            raise ValueError(f"rope.factor must be positive, got {self.factor!r}")
        if self.type == "llama3" and not self.high_freq_factor >= self.low_freq_factor:
            raise ValueError(
                f"rope llama3 scaling needs high_freq_factor > low_freq_factor (or both equal: no blended band, as in "
                f"Llama 4 Scout), got {self.high_freq_factor} and {self.low_freq_factor}"
            )
        if self.type in ("dynamic", "yarn") and self.original_max_position_embeddings < 1:
            raise ValueError(
                f"rope {self.type} scaling needs a positive original_max_position_embeddings, got "
                f"{self.original_max_position_embeddings!r}"
            )


def rotary_embeddings(rope: RopeConfig, head_size: int) -> RotaryEmbeddings:
    """The named-tensors rotary layer that this config describes, for heads of the given size."""
    # Imported here so that configs decode without jax.
    from named_tensors.nn import (
        DynamicNtkRopeScaling,
        LinearRopeScaling,
        Llama3RopeScaling,
        RotaryEmbeddings,
        YarnRopeScaling,
    )

    if rope.type == "linear":
        scaling = LinearRopeScaling(rope.factor)
    elif rope.type == "llama3":
        scaling = Llama3RopeScaling(
            rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings
        )
    elif rope.type == "dynamic":
        scaling = DynamicNtkRopeScaling(rope.factor, rope.original_max_position_embeddings)
    elif rope.type == "yarn":
        scaling = YarnRopeScaling(
            rope.factor,
            rope.original_max_position_embeddings,
            rope.beta_fast,
            rope.beta_slow,
            rope.attention_factor,
            rope.mscale,
            rope.mscale_all_dim,
            rope.truncate,
        )
    else:
        scaling = None
    return RotaryEmbeddings(head_size, rope.theta, scaling)
