"""The model families hf_bridge converts, looked up by HF `model_type` or by our config's type name."""

from __future__ import annotations

from ..errors import HfBridgeError
from .backpack import BACKPACK
from .base import Family
from .gemma import GEMMA
from .gemma2 import GEMMA2
from .gemma3 import GEMMA3
from .gpt2 import GPT2
from .llama import LLAMA
from .mistral import MISTRAL
from .mixtral import MIXTRAL
from .mpt import MPT
from .olmo2 import OLMO2
from .qwen2 import QWEN2
from .qwen3 import QWEN3

FAMILIES: tuple[Family, ...] = (
    GPT2,
    LLAMA,
    MPT,
    BACKPACK,
    MISTRAL,
    MIXTRAL,
    QWEN2,
    QWEN3,
    GEMMA,
    GEMMA2,
    GEMMA3,
    OLMO2,
)


def family_for_hf(model_type: object, where: str) -> Family:
    """The family of an HF config.json's `model_type`."""
    for family in FAMILIES:
        if family.hf_model_type == model_type:
            return family
    known = [f.hf_model_type for f in FAMILIES]
    raise HfBridgeError(
        f"{where} has model_type={model_type!r}, which hf_bridge does not convert (supported: {known}). "
        "hf_bridge never runs a checkpoint's own code (trust_remote_code), so other architectures need a "
        "converter in hf_bridge."
    )


def family_for_ours(our_type: str) -> Family:
    """The family of one of our config types."""
    for family in FAMILIES:
        if family.our_type == our_type:
            return family
    known = [f.our_type for f in FAMILIES]
    raise HfBridgeError(f"Model type {our_type!r} has no Hugging Face mapping in hf_bridge (supported: {known}).")


__all__ = ["FAMILIES", "Family", "family_for_hf", "family_for_ours"]
