"""Backpack: hf_bridge's own safetensors + config.json layout (transformers has no Backpack model).

config.json holds `model_type: "backpack"`, `architectures: ["BackpackLMHeadModel"]`, the GPT-2 keys
(n_embd, n_layer, n_head, n_positions, n_inner, activation_function, layer_norm_epsilon, dropouts, ...) and
`num_senses`, `sense_intermediate_scale` and `use_bias`. The tensors are:

  transformer.*            the GPT-2 transformer, with exactly GPT-2's keys and layouts (Conv1D (in, out))
  sense_net.block.up.weight      (mlp, embed)                 .bias (mlp)
  sense_net.block.down.weight    (embed, mlp)                 .bias (embed)
  sense_net.ln.weight / .bias    (embed)
  sense_net.final.up.weight      (mlp, embed)                 .bias (mlp)
  sense_net.final.down.weight    (senses * embed, mlp)        .bias (senses * embed)
  sense_query.weight             (senses * head_size, embed)  .bias (senses * head_size)
  sense_key.weight               (senses * head_size, embed)  .bias (senses * head_size)

that is, PyTorch nn.Linear's (out, in) layout, with (senses, embed) and (senses, head_size) flattened
row-major; here `mlp` is hidden_dim * sense_intermediate_scale and head_size is hidden_dim / num_senses. The
output head is tied to transformer.wte.weight and not stored. Without biases (use_bias false) no `.bias`
tensor is stored, the transformer's included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lm_models import BackpackConfig

from ..layout import HfTensor, tensor
from . import gpt2
from .base import Family
from .hf_keys import HfConfigReader

SENSE_HEAD = ("senses", "head_size")


def config_from_hf(hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    """BackpackConfig keyword arguments from hf_bridge's Backpack config.json."""
    r = HfConfigReader(hf, where)
    r.expect("tie_word_embeddings", True, (True,), "the Backpack head is tied to the word embeddings")
    use_bias = r.get("use_bias", True)
    kwargs = gpt2.gpt2_keys_from_hf(r)
    kwargs.update(
        num_senses=r.require("num_senses"),
        sense_intermediate_scale=r.get("sense_intermediate_scale", 4),
        use_bias=use_bias,
    )
    r.finish()
    return kwargs


def config_to_hf(config: BackpackConfig, vocab_size: int) -> dict[str, Any]:
    """hf_bridge's Backpack config.json keys for our config."""
    return {
        **gpt2.gpt2_keys_to_hf(config, vocab_size),
        "num_senses": config.num_senses,
        "sense_intermediate_scale": config.sense_intermediate_scale,
        "use_bias": config.use_bias,
        "tie_word_embeddings": True,
    }


def tensors(config: BackpackConfig) -> list[HfTensor]:
    """Every tensor of the Backpack layout (see the module docstring)."""
    transformer = [_under_transformer(t) for t in gpt2.tensors(config)]
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


BACKPACK = Family(
    hf_model_type="backpack",
    our_type="backpack",
    architecture="BackpackLMHeadModel",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    tensors=tensors,
    truncatable=frozenset({"position"}),
)
