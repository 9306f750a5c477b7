"""GPT-2, Llama, MPT, Backpack, Mistral, Mixtral, Qwen 2/3, Gemma 1/2/3 and OLMo 2 language models on named
tensors, behind one interface."""

from importlib import metadata as _metadata

from .backpack import BackpackCache, BackpackConfig, BackpackLMHeadModel, SenseNetwork
from .config import LmConfig, register_model
from .decoder import DecoderBlock, DecoderConfig, DecoderLMHeadModel, DecoderSpec
from .gemma import Gemma2Config, Gemma3Config, GemmaConfig
from .generation import generate
from .gpt2 import Gpt2Block, Gpt2Config, Gpt2LMHeadModel, Gpt2StyleConfig
from .kv_cache import KVCache
from .llama import LlamaBlock, LlamaConfig, LlamaLMHeadModel
from .loss import next_token_loss, next_token_targets
from .mistral import MistralConfig
from .mixtral import MixtralConfig
from .model import LmHeadModel, inference_mode
from .mpt import MptBlock, MptConfig, MptLMHeadModel
from .olmo2 import Olmo2Config
from .qwen import Qwen2Config, Qwen3Config
from .registry import config_registry
from .rope import RopeConfig
from .sampling import sample_next_token, top_k_filter, top_p_filter
from .stacking import stack_layers, unstack_layers, with_gradient_checkpointing

__version__ = _metadata.version("lm-models")  # the installed distribution's: no copy to drift

__all__ = [
    "BackpackCache",
    "BackpackConfig",
    "BackpackLMHeadModel",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLMHeadModel",
    "DecoderSpec",
    "Gemma2Config",
    "Gemma3Config",
    "GemmaConfig",
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
    "MistralConfig",
    "MixtralConfig",
    "MptBlock",
    "MptConfig",
    "MptLMHeadModel",
    "Olmo2Config",
    "Qwen2Config",
    "Qwen3Config",
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
