"""Backpack's config, without jax: the model is in lm_models.backpack."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from named_tensors import Axis

from .config import LmConfig, check_positive
from .gpt2_config import Gpt2StyleConfig, gpt2_keys_from_hf, gpt2_keys_to_hf, gpt2_tensors
from .hf_config import HfConfigReader
from .hf_layout import HfMapping, HfTensor, tensor

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


# The Hugging Face layout of a Backpack, hf_bridge's own (transformers has no Backpack model): config.json holds
# `model_type: "backpack"`, `architectures: ["BackpackLMHeadModel"]`, the GPT-2 keys
# (n_embd, n_layer, n_head, n_positions, n_inner, activation_function, layer_norm_epsilon, dropouts, ...) and
# `num_senses`, `sense_intermediate_scale` and `use_bias`. The tensors are:
#
#   transformer.*            the GPT-2 transformer, with exactly GPT-2's keys and layouts (Conv1D (in, out))
#   sense_net.block.up.weight      (mlp, embed)                 .bias (mlp)
#   sense_net.block.down.weight    (embed, mlp)                 .bias (embed)
#   sense_net.ln.weight / .bias    (embed)
#   sense_net.final.up.weight      (mlp, embed)                 .bias (mlp)
#   sense_net.final.down.weight    (senses * embed, mlp)        .bias (senses * embed)
#   sense_query.weight             (senses * head_size, embed)  .bias (senses * head_size)
#   sense_key.weight               (senses * head_size, embed)  .bias (senses * head_size)
#
# that is, PyTorch nn.Linear's (out, in) layout, with (senses, embed) and (senses, head_size) flattened
# row-major; here `mlp` is hidden_dim * sense_intermediate_scale and head_size is hidden_dim / num_senses. The
# output head is tied to transformer.wte.weight and not stored. Without biases (use_bias false) no `.bias`
# tensor is stored, the transformer's included.

SENSE_HEAD = ("senses", "head_size")


def backpack_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """BackpackConfig keyword arguments from hf_bridge's Backpack config.json."""
    r = HfConfigReader(hf, where)
    r.expect("tie_word_embeddings", True, (True,), "the Backpack head is tied to the word embeddings")
    use_bias = r.get("use_bias", True)
    kwargs = gpt2_keys_from_hf(r)
    kwargs.update(
        num_senses=r.require("num_senses"),
        sense_intermediate_scale=r.get("sense_intermediate_scale", 4),
        use_bias=use_bias,
    )
    r.finish()
    return kwargs


def backpack_to_hf(config: BackpackConfig, vocab_size: int) -> dict[str, Any]:
    """hf_bridge's Backpack config.json keys for our config."""
    return {
        **gpt2_keys_to_hf(config, vocab_size),
        "num_senses": config.num_senses,
        "sense_intermediate_scale": config.sense_intermediate_scale,
        "use_bias": config.use_bias,
        "tie_word_embeddings": True,
    }


def backpack_tensors(config: BackpackConfig) -> list[HfTensor]:
    """Every tensor of the Backpack layout (see the layout above)."""
    transformer = [_under_transformer(t) for t in gpt2_tensors(config)]
    own = [
        tensor("sense_net.block.up.weight", "sense_net.block.up.weight", "mlp", "embed"),
        tensor("sense_net.block.up.bias", "sense_net.block.up.bias", "mlp"),
        tensor("sense_net.block.down.weight", "sense_net.block.down.weight", "embed", "mlp"),
        tensor("sense_net.block.down.bias", "sense_net.block.down.bias", "embed"),
        tensor("sense_net.ln.weight", "sense_net.ln.weight", "embed"),
        tensor("sense_net.ln.bias", "sense_net.ln.bias", "embed"),
        tensor("sense_net.final.up.weight", "sense_net.final.up.weight", "mlp", "embed"),
        tensor("sense_net.final.up.bias", "sense_net.final.up.bias", "mlp"),
        tensor("sense_net.final.down.weight", "sense_net.final.down.weight", ("senses", "embed"), "mlp"),
        tensor("sense_net.final.down.bias", "sense_net.final.down.bias", ("senses", "embed")),
        tensor("sense_query.weight", "sense_query.weight", SENSE_HEAD, "embed"),
        tensor("sense_query.bias", "sense_query.bias", SENSE_HEAD),
        tensor("sense_key.weight", "sense_key.weight", SENSE_HEAD, "embed"),
        tensor("sense_key.bias", "sense_key.bias", SENSE_HEAD),
    ]
    return [t for t in transformer + own if config.use_bias or not t.key.endswith(".bias")]


def _under_transformer(spec: HfTensor) -> HfTensor:
    # GPT-2's keys already start with "transformer."; our parameters live under the `transformer` field.
    parts = tuple(dataclasses.replace(p, path="transformer." + p.path) for p in spec.parts)
    return dataclasses.replace(spec, parts=parts)


BackpackConfig.hf_mapping = HfMapping(
    hf_model_type="backpack",
    architecture="BackpackLMHeadModel",
    config_from_hf=backpack_from_hf,
    config_to_hf=backpack_to_hf,
    tensors=backpack_tensors,
    truncatable=frozenset({"position"}),
)
