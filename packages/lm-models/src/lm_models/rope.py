"""RopeConfig: rotary position embedding settings (theta and an optional linear or llama3 frequency scaling)."""

from __future__ import annotations

from dataclasses import dataclass

from named_tensors.nn.rotary import LinearRopeScaling, Llama3RopeScaling, RotaryEmbeddings

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embeddings: `type` default (plain), linear (positions / factor) or llama3 (per-band scaling).

    The keys match Levanter's and Hugging Face's `rope_scaling`: `factor`, `low_freq_factor`,
    `high_freq_factor` and `original_max_position_embeddings` (the last three are read by llama3 only).
    """

    type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope.type={self.type!r} is not supported; use one of {list(ROPE_TYPES)}")
        if self.theta <= 0:
            raise ValueError(f"rope.theta must be positive, got {self.theta!r}")
        if self.factor <= 0:
            raise ValueError(f"rope.factor must be positive, got {self.factor!r}")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope llama3 scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


def rotary_embeddings(rope: RopeConfig, head_size: int) -> RotaryEmbeddings:
    """The named-tensors rotary layer that this config describes, for heads of the given size."""
    if rope.type == "linear":
        scaling = LinearRopeScaling(rope.factor)
    elif rope.type == "llama3":
        scaling = Llama3RopeScaling(
            rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_position_embeddings
        )
    else:
        scaling = None
    return RotaryEmbeddings(head_size, rope.theta, scaling)
