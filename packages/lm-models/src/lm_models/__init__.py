"""GPT-2, Llama, MPT and Backpack language models on named tensors, behind one interface."""

from importlib import metadata as _metadata

from .backpack import BackpackCache, BackpackConfig, BackpackLMHeadModel, SenseNetwork
from .config import LmConfig, register_model
from .generation import generate
from .gpt2 import Gpt2Block, Gpt2Config, Gpt2LMHeadModel, Gpt2StyleConfig
from .kv_cache import KVCache
from .llama import LlamaBlock, LlamaConfig, LlamaLMHeadModel
from .loss import next_token_loss, next_token_targets
from .model import LmHeadModel, inference_mode
from .mpt import MptBlock, MptConfig, MptLMHeadModel
from .registry import config_registry
from .rope import RopeConfig
from .sampling import sample_next_token, top_k_filter, top_p_filter
from .stacking import stack_layers, unstack_layers, with_gradient_checkpointing

__version__ = _metadata.version("lm-models")  # the installed distribution's: no copy to drift

__all__ = [
    "BackpackCache",
    "BackpackConfig",
    "BackpackLMHeadModel",
    "Gpt2Block",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "Gpt2StyleConfig",
    "KVCache",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "LmConfig",
    "LmHeadModel",
    "MptBlock",
    "MptConfig",
    "MptLMHeadModel",
    "RopeConfig",
    "SenseNetwork",
    "config_registry",
    "generate",
    "inference_mode",
    "next_token_loss",
    "next_token_targets",
    "register_model",
    "sample_next_token",
    "stack_layers",
    "top_k_filter",
    "top_p_filter",
    "unstack_layers",
    "with_gradient_checkpointing",
]
