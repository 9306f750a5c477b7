"""Which kernel computes a layer's attention: ours (materialised scores), ours blockwise, or a fused one.

`attn_backend` (Levanter's key): `default` picks cuDNN's fused kernel (through jax.nn.dot_product_attention) on
an NVIDIA GPU and the Pallas splash kernel on a TPU where they apply, and ours elsewhere; `vanilla` and
`jax_flash` are ours, materialised and blockwise; `xla` and `cudnn` ask for jax.nn.dot_product_attention's
implementation of that name, `splash` for the splash kernel (interpreted off a TPU: slow, for checking). Where
the fused kernel cannot compute a layer exactly as ours would (a bias, dropout, a KV cache, per-layer windows
whose values are not known; soft-capping but for splash; for splash, a mask other than packed rows' segment ids,
or a length that is not a multiple of 128), the layer uses ours, and a one-line note says why, once. The
platform is the one `kernels_for` names, if any (kernel_platform.py).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .kernel_platform import kernel_choices

_noted: set[str] = set()


def note_once(text: str) -> None:
    """A one-line note, shown once per process for each text (kept with the choices instead, under kernels_for)."""
    choices = kernel_choices()
    if choices is not None:
        if text not in choices.notes:
            choices.notes.append(text)
    elif text not in _noted:
        _noted.add(text)
        warnings.warn(text, stacklevel=3)


# The platform each fused kernel is built for; "xla" runs anywhere. Elsewhere, splash runs interpreted.
KERNEL_HOMES = {"cudnn": "gpu", "splash": "tpu"}


@dataclass(frozen=True)
class AttentionCall:
    """What the kernel choice depends on in one attention call."""

    dtype: Any
    length: int
    cached: bool
    bias: bool
    dropout: bool
    masked: bool  # a boolean mask beyond packed rows' segment ids (padding, forgetful causal masking)
    window: Any


def choose_kernel(options: Any, call: AttentionCall) -> tuple:
    """("fused", implementation), ("blockwise",) or ("vanilla",) for one attention call; under kernels_for, a fused
    kernel off its home is ("blockwise", implementation), ours blockwise standing in for it."""
    choices = kernel_choices()
    if choices is None:
        return _choose(options, call, jax.default_backend())
    kernel = _choose(options, call, choices.platform)
    choices.chosen.add(kernel)
    home = KERNEL_HOMES.get(kernel[1]) if kernel[0] == "fused" else None
    if home is not None and jax.default_backend() != home:
        return ("blockwise", kernel[1])  # the stand-in (kernels_for)
    return kernel


def takes_segment_ids(kernel: tuple) -> bool:
    """Whether the kernel (or the one a stand-in stands for) takes packed rows' segment ids; others take a whole
    (position, key_position) mask."""
    return kernel == ("blockwise",) or kernel[-1] == "splash"


def _choose(options: Any, call: AttentionCall, platform: str) -> tuple:
    backend = options.backend
    ours = ("blockwise",) if options.use_flash_attention or backend == "jax_flash" else ("vanilla",)
    if backend in ("vanilla", "jax_flash"):
        return ours
    if backend == "default":
        implementation = {"gpu": "cudnn", "tpu": "splash"}.get(platform)
        if implementation is None:
            return ours
    else:
        implementation = backend
    why = _unfit(options, call, implementation, platform)
    if why:
        note_once(f"attention: {implementation} cannot compute these layers ({why}); they use ours instead")
        return ours
    if implementation == "splash" and platform != "tpu":
        note_once("attention: splash runs in Pallas's interpreter off a TPU: slow, for checking results")
    return ("fused", implementation)


def _unfit(options: Any, call: AttentionCall, implementation: str, platform: str) -> str | None:
    """Why the fused kernel would not compute exactly what ours does (None: it would)."""
    cached, bias, dropout, window, dtype = call.cached, call.bias, call.dropout, call.window, call.dtype
    if cached:
        return "a KV cache"
    if bias:
        return "an additive bias"
    if options.logits_soft_cap is not None and implementation != "splash":
        return "soft-capped scores"
    if dropout:
        return "dropout on the attention weights"
    if window is not None and not isinstance(window, int) and options.layer_windows is None:
        return "per-layer sliding windows"
    if implementation == "cudnn":
        if platform != "gpu":
            return f"no NVIDIA GPU here (the backend is {platform})"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"{jnp.dtype(dtype).name} compute; cuDNN's kernel needs bfloat16 or float16 (trainer.mp)"
        size = options.HeadSize.size
        if size % 8 or size > 128:
            return f"head size {size}; cuDNN's kernel needs a multiple of 8, at most 128"
    if implementation == "splash":
        if call.masked:
            return "an attention mask other than packed rows' segment ids (padded rows, forgetful causal masking)"
        if call.length % 128:
            return f"sequence length {call.length}; the splash kernel needs a multiple of 128"
    return None
