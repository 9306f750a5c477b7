"""RoPE settings in config.json <-> RopeConfig: rope_theta and the scalings linear, dynamic, yarn and llama3.

transformers < 5 writes `rope_theta` plus a `rope_scaling` dict (with `rope_type` or the older `type`);
transformers 5 writes one `rope_parameters` dict that holds rope_theta too (and, for Gemma 3, one such dict per
layer type). Both are read; the export writes rope_theta and rope_scaling, which every version reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lm_models import RopeConfig

from ..errors import HfBridgeError
from .hf_keys import HfConfigReader

# The keys each rope type reads besides its type and theta: (required, optional).
ROPE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"),
    ),
}


def rope_section(r: HfConfigReader) -> tuple[str, dict[str, Any]]:
    """The name and contents of the config's rope dict (rope_parameters, else rope_scaling, else empty)."""
    section = "rope_parameters" if r.hf.get("rope_parameters") is not None else "rope_scaling"
    params = r.get(section, {})
    r.ignore("rope_parameters", "rope_scaling")
    if not isinstance(params, Mapping):
        raise HfBridgeError(f"{r.where}: {section} must be a JSON object (or null), got {params!r}.")
    return section, dict(params)


def rope_from_hf(r: HfConfigReader, params: Mapping[str, Any] | None = None, where: str | None = None) -> RopeConfig:
    """RopeConfig from the config's rope dict (or `params`, one layer type's dict) and rope_theta."""
    if params is None:
        section, params = rope_section(r)
    else:
        section = where or "rope_parameters"
    params = dict(params)
    theta = params.pop("rope_theta", None)
    top_theta = r.get("rope_theta")
    if theta is None:
        theta = 10000.0 if top_theta is None else top_theta
    elif top_theta is not None and where is None and float(top_theta) != float(theta):
        raise r.fail("rope_theta", f"differs from {section}.rope_theta={theta}; keep one value")
    kind = params.pop("rope_type", None)
    legacy_kind = params.pop("type", None)
    kind = kind or legacy_kind or "default"
    if kind not in ROPE_KEYS:
        raise HfBridgeError(
            f"{r.where}: {section} has rope type {kind!r}, which hf_bridge does not support (lm_models implements "
            f"{list(ROPE_KEYS)}), and converting without it would change the model's outputs. Use a checkpoint "
            "whose rope type is one of those."
        )
    required, optional = ROPE_KEYS[kind]
    missing = [k for k in required if params.get(k) is None]
    extra = sorted(k for k in params if k not in required + optional and params[k] is not None)
    if missing:
        raise HfBridgeError(f"{r.where}: {section} of type {kind!r} lacks {missing}; add them.")
    if extra:
        raise HfBridgeError(
            f"{r.where}: {section} of type {kind!r} has keys {extra} that lm_models' rope does not implement; "
            "converting would silently change the model."
        )
    fields = {k: params[k] for k in required + optional if params.get(k) is not None}
    if kind == "dynamic":
        # Dynamic NTK scales past the model's max_position_embeddings.
        fields["original_max_position_embeddings"] = int(r.get("max_position_embeddings", 2048))
    try:
        return RopeConfig(type=kind, theta=float(theta), **fields)
    except (TypeError, ValueError) as e:
        raise HfBridgeError(f"{r.where}: {section} is not valid: {e}") from None


def rope_to_hf(rope: RopeConfig) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and a rope_scaling dict (None for plain RoPE), readable by transformers 4 and 5."""
    if rope.type == "default":
        return rope.theta, None
    scaling: dict[str, Any] = {"rope_type": rope.type, "type": rope.type, "factor": rope.factor}
    if rope.type == "llama3":
        scaling.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    if rope.type == "yarn":
        scaling.update(
            original_max_position_embeddings=rope.original_max_position_embeddings,
            beta_fast=rope.beta_fast,
            beta_slow=rope.beta_slow,
            truncate=rope.truncate,
        )
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(rope, name) is not None:
                scaling[name] = getattr(rope, name)
    return rope.theta, scaling


def max_positions_to_hf(seq_len: int, rope: RopeConfig) -> int:
    """config.json's max_position_embeddings: seq_len, or where dynamic NTK scaling starts (which it sets)."""
    return rope.original_max_position_embeddings if rope.type == "dynamic" else seq_len
