"""Config mapping both ways: an HF config.json dict <-> our lm_models config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lm_models import LmConfig

from .errors import HfBridgeError
from .mapping import config_from_hf, config_to_hf, family_for_hf, family_for_ours, unwrap
from .reader import log


def hf_config_to_ours(hf_config: Mapping[str, Any], *, where: str = "config.json", **overrides: Any) -> LmConfig:
    """Our config for an HF config.json dict; `overrides` set fields HF has no word for (e.g. scan_layers)."""
    if not isinstance(hf_config, Mapping):
        raise HfBridgeError(f"{where} must hold a JSON object, got {type(hf_config).__name__}.")
    hf_config, where, wrapper = unwrap(hf_config, where)  # a multimodal model's text model
    if wrapper is not None:
        log.info("%s: %s", where, wrapper.note)
    cls, family = family_for_hf(hf_config.get("model_type"), where)
    kwargs = config_from_hf(family, hf_config, where)
    names = {f.name for f in dataclasses.fields(cls)}  # pyright: ignore[reportArgumentType] (every registered family config is a dataclass)
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise HfBridgeError(f"{cls.__name__} has no field(s) {unknown} to override; its fields are {sorted(names)}.")
    kwargs.update(overrides)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise HfBridgeError(f"{where} does not make a valid {cls.__name__}: {e}") from None


def vocab_size_of(hf_config: Mapping[str, Any], where: str = "config.json") -> int:
    """The vocabulary size an HF config.json declares."""
    hf_config, where, _ = unwrap(hf_config, where)
    size = hf_config.get("vocab_size")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise HfBridgeError(f"{where} needs a positive integer 'vocab_size', got {size!r}.")
    return size


def our_config_to_hf(
    config: LmConfig,
    vocab_size: int,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """An HF config.json dict for our config, loadable by transformers' AutoConfig."""
    family = family_for_ours(config.model_type)
    hf = {
        "model_type": family.hf_model_type,
        "architectures": [family.architecture],
        **config_to_hf(family, config, vocab_size),
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        # transformers 5 reads "dtype", older versions "torch_dtype".
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    return hf
