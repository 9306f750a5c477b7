"""A family's Hugging Face mapping, found through the lm_models registry (each family module declares its own)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import HfConfigError, HfConfigReader, HfMapping, HfWrapper, LmConfig, hf_families

from .errors import HfBridgeError


def family_for_hf(model_type: object, where: str) -> tuple[type[LmConfig], HfMapping]:
    """The config class and mapping of an HF config.json's `model_type`."""
    families = _families()
    for cls, mapping in families.values():
        if mapping.hf_model_type == model_type:
            return cls, mapping
    known = sorted(mapping.hf_model_type for _, mapping in families.values())
    raise HfBridgeError(
        f"{where} has model_type={model_type!r}, which hf_bridge does not convert (supported: {known}). "
        "hf_bridge never runs a checkpoint's own code (trust_remote_code), so other architectures need a "
        "family module in lm_models with its hf_mapping."
    )


def unwrap(hf_config: Mapping[str, Any], where: str) -> tuple[Mapping[str, Any], str, HfWrapper | None]:
    """The family's own config.json within an outer model's (Llama 4's text_config in a multimodal llama4), where
    it is, and the outer model's HfWrapper; the config itself, `where` and None for a family's own config.json."""
    model_type = hf_config.get("model_type")
    found = [w for _, m in _families().values() for w in m.wrappers if w.model_type == model_type]
    if not found:
        return hf_config, where, None
    wrapper = found[0]
    outer = HfConfigReader(hf_config, where)
    inner = outer.get(wrapper.config_key)
    if not isinstance(inner, Mapping):
        raise HfBridgeError(
            f"{where} describes a {model_type} model, whose text model's config must be the JSON object "
            f"{wrapper.config_key!r}; got {inner!r}. Use the checkpoint's config.json as transformers wrote it."
        )
    outer.ignore(*wrapper.ignored_keys)
    inner_where = f"{where} ({wrapper.config_key})"
    tied = outer.get("tie_word_embeddings")
    if tied is not None and bool(tied) != bool(inner.get("tie_word_embeddings", False)):
        raise HfBridgeError(
            f"{where}: tie_word_embeddings={tied} differs from {wrapper.config_key}.tie_word_embeddings="
            f"{inner.get('tie_word_embeddings', False)}; the text model's head would be ambiguous. Make them agree."
        )
    try:
        outer.finish()
    except HfConfigError as e:
        raise HfBridgeError(str(e)) from None
    return inner, inner_where, wrapper


def family_for_ours(our_type: str) -> HfMapping:
    """The mapping of one of our config types."""
    families = _families()
    if our_type not in families:
        raise HfBridgeError(
            f"Model type {our_type!r} has no Hugging Face mapping in lm_models (supported: {sorted(families)}); "
            "its config class needs an hf_mapping to be converted."
        )
    return families[our_type][1]


def config_from_hf(mapping: HfMapping, hf_config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The family's reading of a config.json, its errors as HfBridgeError."""
    try:
        return mapping.config_from_hf(hf_config, where)
    except HfConfigError as e:
        raise HfBridgeError(str(e)) from None


def config_to_hf(mapping: HfMapping, config: LmConfig, vocab_size: int) -> dict[str, Any]:
    """The family's config.json keys for our config, its refusals as HfBridgeError."""
    try:
        return mapping.config_to_hf(config, vocab_size)
    except HfConfigError as e:
        raise HfBridgeError(str(e)) from None


def _families() -> dict[str, tuple[type[LmConfig], HfMapping]]:
    try:
        return hf_families()
    except ValueError as e:  # two families claim one HF model_type
        raise HfBridgeError(str(e)) from None
