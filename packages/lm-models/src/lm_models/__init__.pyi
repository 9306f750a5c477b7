"""The public names of lm_models (the one list: `__init__.py` reads it to import each lazily)."""

from .backpack import BackpackCache, BackpackLMHeadModel, SenseNetwork
from .backpack_config import BackpackConfig
from .config import SCAN_UNROLL_AUTO, LmConfig, hf_families, register_model, resolve_scan_unroll
from .decoder import DecoderBlock, DecoderLMHeadModel
from .decoder_config import DecoderConfig, DecoderSpec
from .deepseek_v3 import DeepseekV3Config
from .deepseek_v3_model import DeepseekV3Block, DeepseekV3LMHeadModel
from .gemma import Gemma2Config, Gemma3Config, GemmaConfig
from .generation import generate
from .gpt2 import Gpt2Block, Gpt2LMHeadModel
from .gpt2_config import Gpt2Config, Gpt2StyleConfig
from .gpt_oss import GptOssConfig
from .hf_config import HfConfigError, HfConfigReader
from .hf_layout import HfMapping, HfTensor, HfWrapper, Part
from .kernel_platform import kernels_for
from .kv_cache import KVCache
from .llama import LlamaConfig
from .llama4 import Llama4Config
from .loss import ACCELERATOR_BLOCK_SIZE, next_token_loss, next_token_targets
from .mistral import MistralConfig
from .mixtral import MixtralConfig
from .model import LmHeadModel, TiedHeadModel, inference_mode
from .mpt import MptBlock, MptLMHeadModel
from .mpt_config import MptConfig
from .olmo2 import Olmo2Config
from .paged_cache import PagedKVCache, init_paged_cache, paged_forward, supports_paging
from .qwen import Qwen2Config, Qwen3Config
from .qwen3_moe import Qwen3MoeConfig
from .registry import config_registry
from .rope import RopeConfig
from .sampling import sample_next_token, top_k_filter, top_p_filter
from .stacking import stack_layers, unstack_layers, with_gradient_checkpointing

__version__: str

__all__ = [
    "ACCELERATOR_BLOCK_SIZE",
    "SCAN_UNROLL_AUTO",
    "BackpackCache",
    "BackpackConfig",
    "BackpackLMHeadModel",
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLMHeadModel",
    "DecoderSpec",
    "DeepseekV3Block",
    "DeepseekV3Config",
    "DeepseekV3LMHeadModel",
    "Gemma2Config",
    "Gemma3Config",
    "GemmaConfig",
    "Gpt2Block",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "Gpt2StyleConfig",
    "GptOssConfig",
    "HfConfigError",
    "HfConfigReader",
    "HfMapping",
    "HfTensor",
    "HfWrapper",
    "KVCache",
    "Llama4Config",
    "LlamaConfig",
    "LmConfig",
    "LmHeadModel",
    "MistralConfig",
    "MixtralConfig",
    "MptBlock",
    "MptConfig",
    "MptLMHeadModel",
    "Olmo2Config",
    "PagedKVCache",
    "Part",
    "Qwen2Config",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "RopeConfig",
    "SenseNetwork",
    "TiedHeadModel",
    "config_registry",
    "generate",
    "hf_families",
    "inference_mode",
    "init_paged_cache",
    "kernels_for",
    "next_token_loss",
    "next_token_targets",
    "paged_forward",
    "register_model",
    "resolve_scan_unroll",
    "sample_next_token",
    "stack_layers",
    "supports_paging",
    "top_k_filter",
    "top_p_filter",
    "unstack_layers",
    "with_gradient_checkpointing",
]
