"""Neural-network layers on NamedArrays: linear, embedding, norms, MLPs, attention, rotary, ALiBi, losses."""

from .activations import ACTIVATION_NAMES, activation_fn
from .alibi import alibi_bias, alibi_slopes
from .attention import dot_product_attention
from .blockwise_attention import blockwise_attention
from .blockwise_loss import blockwise_cross_entropy_loss
from .dropout import Dropout
from .embedding import Embedding
from .heads import HEADS, KV_HEADS, QUERY_GROUP, group_query_heads, ungroup_query_heads
from .linear import Linear
from .lora import (
    LORA_RANK,
    LoraConfig,
    LoraLinear,
    apply_lora,
    linear_paths,
    lora_params,
    lora_paths,
    merge_lora,
    select_targets,
    with_lora_dropout_keys,
)
from .loss import cross_entropy_loss
from .masks import and_masks, causal_mask, length_mask, or_masks, packed_causal_mask, prefix_lm_mask, segment_mask
from .mlp import MLP, GatedMLP
from .normalization import LayerNorm, RMSNorm
from .rotary import LinearRopeScaling, Llama3RopeScaling, RotaryEmbeddings

__all__ = [
    "ACTIVATION_NAMES",
    "HEADS",
    "KV_HEADS",
    "LORA_RANK",
    "MLP",
    "QUERY_GROUP",
    "Dropout",
    "Embedding",
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "LoraConfig",
    "LoraLinear",
    "RMSNorm",
    "RotaryEmbeddings",
    "activation_fn",
    "alibi_bias",
    "alibi_slopes",
    "and_masks",
    "apply_lora",
    "blockwise_attention",
    "blockwise_cross_entropy_loss",
    "causal_mask",
    "cross_entropy_loss",
    "dot_product_attention",
    "group_query_heads",
    "length_mask",
    "linear_paths",
    "lora_params",
    "lora_paths",
    "merge_lora",
    "or_masks",
    "packed_causal_mask",
    "prefix_lm_mask",
    "segment_mask",
    "select_targets",
    "ungroup_query_heads",
    "with_lora_dropout_keys",
]
