"""Backpack's config, without jax: the model is in lm_models.backpack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from named_tensors import Axis

from .config import LmConfig, check_positive
from .gpt2_config import Gpt2StyleConfig

if TYPE_CHECKING:
    pass


SENSES = "senses"


@LmConfig.register_subclass("backpack")
@dataclass(frozen=True)
class BackpackConfig(Gpt2StyleConfig):
    """Backpack hyperparameters: the GPT-2 keys plus `num_senses` and `sense_intermediate_scale`."""

    num_senses: int = 16
    """Sense vectors per token; must divide hidden_dim."""
    sense_intermediate_scale: int = 4
    """The sense network's MLP hidden width as a multiple of hidden_dim."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "num_senses", "sense_intermediate_scale")
        if self.hidden_dim % self.num_senses != 0:
            raise ValueError(
                f"BackpackConfig: num_senses={self.num_senses} does not divide hidden_dim={self.hidden_dim}; "
                "the sense weights use hidden_dim / num_senses features per sense"
            )

    @property
    def Senses(self) -> Axis:
        return Axis(SENSES, self.num_senses)

    @property
    def SenseMlp(self) -> Axis:
        return Axis("mlp", self.hidden_dim * self.sense_intermediate_scale)

    @property
    def SenseHeadSize(self) -> Axis:
        return Axis("head_size", self.hidden_dim // self.num_senses)

    model_class = "lm_models.backpack:BackpackLMHeadModel"

    def flops_per_token(self, vocab_size: int, seq_len: int | None = None) -> float:
        """Training FLOPs per token: the GPT-2 transformer, the sense network, and the sense mixing."""
        seq = seq_len or self.seq_len
        E, M, S = self.hidden_dim, self.SenseMlp.size, self.num_senses
        sense_net_weights = 2 * E * M + E * M + M * S * E
        weight_projections = 2 * E * E
        # Scores q·k over seq keys for every sense, then the sense-weighted sum of (senses, embed) values.
        mixing_forward = 2 * seq * E + 2 * seq * S * E
        extra = 3.0 * (2.0 * (sense_net_weights + weight_projections) + mixing_forward)
        return self.transformer_flops_per_token(vocab_size, seq_len) + extra
