"""Hugging Face checkpoints (config.json + safetensors) and tokenizers to and from lm_models."""

from importlib import metadata as _metadata

from .config import hf_config_to_ours, our_config_to_hf
from .errors import HfBridgeError
from .load import check_compatible, load_pretrained, load_weights, read_hf_config, read_model_config
from .output_dir import check_export_target
from .peft import hf_lora_targets, load_peft_adapter, save_peft_adapter
from .save import save_pretrained
from .tokenizer import load_special_tokens, load_tokenizer, save_tokenizer

__version__ = _metadata.version("hf-bridge")  # the installed distribution's: no copy to drift

__all__ = [
    "HfBridgeError",
    "check_compatible",
    "check_export_target",
    "hf_config_to_ours",
    "hf_lora_targets",
    "load_peft_adapter",
    "load_pretrained",
    "load_special_tokens",
    "load_tokenizer",
    "load_weights",
    "our_config_to_hf",
    "read_hf_config",
    "read_model_config",
    "save_peft_adapter",
    "save_pretrained",
    "save_tokenizer",
]
