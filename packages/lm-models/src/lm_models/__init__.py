"""GPT-2, Llama, MPT, Backpack, Mistral, Mixtral, Qwen 2/3, Qwen3-MoE, Gemma 1/2/3, OLMo 2, gpt-oss,
DeepSeek-V3 and Llama 4 language models on named tensors, behind one interface."""

import importlib as _importlib
from importlib import metadata as _metadata

from named_tensors import lazy_exports

__version__ = _metadata.version("lm-models")  # the installed distribution's: no copy to drift

# The modules of the configs, which need no jax; the models (jax) load together, on first use of one.
_CONFIG_MODULES = (
    ".backpack_config",
    ".config",
    ".decoder_config",
    ".decoder_hf",
    ".deepseek_v3",
    ".gemma",
    ".gpt2_config",
    ".gpt_oss",
    ".hf_config",
    ".hf_layout",
    ".llama",
    ".llama4",
    ".mistral",
    ".mixtral",
    ".mpt_config",
    ".olmo2",
    ".qwen",
    ".qwen3_moe",
    ".registry",
    ".rope",
)
__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__, light=_CONFIG_MODULES)

# Each family config registers its `type:` name when imported: import them now, so that a config decodes (and
# is checked) before jax is imported.
for _module in _CONFIG_MODULES:
    _importlib.import_module(_module, __name__)
