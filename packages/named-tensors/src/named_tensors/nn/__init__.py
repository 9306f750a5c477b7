"""Neural-network layers on NamedArrays: linear (plain or fp8/int8 quantized), embedding, norms, MLPs, attention,
rotary, ALiBi, mixtures of experts, losses."""

# Importing _indexing attaches NamedArray's indexing (x["position", 0:4], x.at[...]), whichever layer module
# a user imports first.
from .. import _indexing
from .._layer_names import ACTIVATION_NAMES, DEFAULT_MOE_BLOCK_SIZE
from .activations import activation_fn
from .alibi import alibi_bias, alibi_slopes
from .attention import dot_product_attention
from .blockwise_attention import blockwise_attention
from .blockwise_loss import blockwise_cross_entropy_loss
from .device_view import DeviceView, device_view, one_device
from .dropout import Dropout
from .embedding import Embedding
from .fused_attention import fused_attention
from .grouped_moe import (
    GroupLimitedMoE,
    balance_bias_update,
    expert_load,
    group_limited_routing,
    sequence_balance_loss,
)
from .heads import HEADS, KV_HEADS, QUERY_GROUP, group_query_heads, ungroup_query_heads
from .latent_attention import LatentAttention, LatentCache
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
from .masks import (
    AttentionMask,
    and_masks,
    causal_mask,
    chunked_mask,
    forgetful_causal_mask,
    length_mask,
    or_masks,
    packed_causal_mask,
    prefix_lm_mask,
    segment_mask,
    sliding_window_mask,
    split_mask,
)
from .mlp import MLP, GatedMLP
from .moe import (
    EXPERTS,
    ROUTER_LOAD,
    TOP_EXPERTS,
    GatedExperts,
    MixtureOfExperts,
    load_balancing_loss,
    router_z_loss,
    top_k_routing,
)
from .normalization import LayerNorm, RMSNorm
from .quantized_matmul import (
    Fp8Matmul,
    Int8Matmul,
    amax_histories,
    has_amax_histories,
    plain_linears,
    quantize_linears,
    record_amax,
)
from .ring_attention import ring_attention, ring_mesh_axis
from .rotary import (
    DynamicNtkRopeScaling,
    LinearRopeScaling,
    Llama3RopeScaling,
    RotaryEmbeddings,
    YarnRopeScaling,
    rotate,
)
from .shared_expert_moe import SharedExpertMoE, sigmoid_top_k_routing
from .softcap import soft_cap
from .splash_attention import splash_attention, splash_block_size

__all__ = [
    "ACTIVATION_NAMES",
    "DEFAULT_MOE_BLOCK_SIZE",
    "EXPERTS",
    "HEADS",
    "KV_HEADS",
    "LORA_RANK",
    "MLP",
    "QUERY_GROUP",
    "ROUTER_LOAD",
    "TOP_EXPERTS",
    "AttentionMask",
    "DeviceView",
    "Dropout",
    "DynamicNtkRopeScaling",
    "Embedding",
    "Fp8Matmul",
    "GatedExperts",
    "GatedMLP",
    "GroupLimitedMoE",
    "Int8Matmul",
    "LatentAttention",
    "LatentCache",
    "LayerNorm",
    "Linear",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "LoraConfig",
    "LoraLinear",
    "MixtureOfExperts",
    "RMSNorm",
    "RotaryEmbeddings",
    "SharedExpertMoE",
    "YarnRopeScaling",
    "activation_fn",
    "alibi_bias",
    "alibi_slopes",
    "amax_histories",
    "and_masks",
    "apply_lora",
    "balance_bias_update",
    "blockwise_attention",
    "blockwise_cross_entropy_loss",
    "causal_mask",
    "chunked_mask",
    "cross_entropy_loss",
    "device_view",
    "dot_product_attention",
    "expert_load",
    "forgetful_causal_mask",
    "fused_attention",
    "group_limited_routing",
    "group_query_heads",
    "has_amax_histories",
    "length_mask",
    "linear_paths",
    "load_balancing_loss",
    "lora_params",
    "lora_paths",
    "merge_lora",
    "one_device",
    "or_masks",
    "packed_causal_mask",
    "plain_linears",
    "prefix_lm_mask",
    "quantize_linears",
    "record_amax",
    "ring_attention",
    "ring_mesh_axis",
    "rotate",
    "router_z_loss",
    "segment_mask",
    "select_targets",
    "sequence_balance_loss",
    "sigmoid_top_k_routing",
    "sliding_window_mask",
    "soft_cap",
    "splash_attention",
    "splash_block_size",
    "split_mask",
    "top_k_routing",
    "ungroup_query_heads",
    "with_lora_dropout_keys",
]
