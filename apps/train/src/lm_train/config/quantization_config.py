"""The `trainer.quantization` section: fp8 or int8 matmuls in the model's Linear layers (Levanter's keys)."""

from __future__ import annotations

from dataclasses import dataclass

from lm_train.config.lora_config import ModuleNames
from lm_train.errors import ConfigError

FP8_SCALINGS = ("delayed", "current")

DEFAULT_TARGETS = r"(?!(.*\.)?lm_head$).*"
"""What targets: null stands for: every Linear but the output head (the attention and MLP projections; an
embedding is no Linear). Levanter's null quantizes the head too: give `targets: ".*"` for that."""


@dataclass(frozen=True)
class QuantizationConfig:
    """Quantized training: the targeted Linear layers multiply in fp8 or int8; the weights stay in their dtype."""

    fp8: bool = False
    """fp8 matmuls: e4m3 inputs and weights, e5m2 gradients, per-tensor scales, f32 accumulation."""
    int8: bool = False
    """int8 matmuls: per-token input and per-output-channel weight scales, int32 accumulation; gradients
    straight-through in the compute dtype."""
    targets: ModuleNames | None = None
    """The Linear layers to quantize: a list of names that layer paths end with (e.g. [q_proj, up]), or one regex
    matched from the start of each path; null: every Linear but the output head (lm_head)."""
    amax_history_length: int = 1024
    """fp8 delayed scaling: steps of amax kept per tensor; the scale uses their max (Levanter's key)."""
    scaling: str = "delayed"
    """fp8 scales: `delayed` (from the amax history, kept in the checkpoint) or `current` (this step's amax)."""
    compute_dtype: str | None = None
    """Levanter's key; here the matmuls' unquantized side uses trainer.mp's compute dtype, so only null is taken."""

    def __post_init__(self) -> None:
        if self.fp8 and self.int8:
            raise ConfigError(
                "trainer.quantization sets both fp8 and int8: a layer multiplies in one format. Set one of them "
                "to false."
            )
        if self.scaling not in FP8_SCALINGS:
            raise ConfigError(
                f"trainer.quantization.scaling: unknown scaling {self.scaling!r}; choose `delayed` (the max of "
                "an amax history, Transformer Engine's default) or `current` (this step's amax)."
            )
        length = self.amax_history_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(
                f"trainer.quantization.amax_history_length must be a positive number of steps, e.g. 1024; got "
                f"{length!r}."
            )
        if self.targets is not None and not self.targets:
            raise ConfigError(
                "trainer.quantization.targets is empty; name Linear layers (e.g. [q_proj, v_proj]) or leave it out "
                "for every Linear but the head."
            )
        if self.compute_dtype is not None:
            raise ConfigError(
                f"trainer.quantization.compute_dtype={self.compute_dtype!r} is not taken: the quantized matmuls "
                "compute in trainer.mp's compute dtype (e.g. mp: p=f32,c=bfloat16). Remove the key or set it to null."
            )

    @property
    def mode(self) -> str | None:
        """`fp8`, `int8`, or None when neither is set (the section then changes nothing)."""
        return "fp8" if self.fp8 else "int8" if self.int8 else None

    @property
    def delayed(self) -> bool:
        """Whether the model keeps amax histories (fp8 with delayed scaling)."""
        return self.fp8 and self.scaling == "delayed"

    def target_layers(self) -> str | tuple[str, ...]:
        """The targets as named_tensors' quantize_linears takes them."""
        return DEFAULT_TARGETS if self.targets is None else self.targets
