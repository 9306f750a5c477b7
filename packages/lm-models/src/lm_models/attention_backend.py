"""Which kernel computes a layer's attention: ours (materialised scores), ours blockwise, or jax's fused one.

`attn_backend` (Levanter's key): `default` picks cuDNN's fused kernel (through jax.nn.dot_product_attention) on
an NVIDIA GPU where it applies, and ours elsewhere; `vanilla` and `jax_flash` are ours, materialised and
blockwise; `xla` and `cudnn` ask for jax.nn.dot_product_attention's implementation of that name. Where the
fused kernel cannot compute a layer exactly as ours would (a bias, soft-capping, dropout, a KV cache, a
per-layer window), the layer uses ours, and a one-line note says why, once. The platform is the one
`kernels_for` names, if any (kernel_platform.py).
"""

from __future__ import annotations

import warnings
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


def choose_kernel(options: Any, dtype: Any, *, cached: bool, bias: bool, dropout: bool, window: Any) -> tuple:
    """("fused", implementation), ("blockwise",) or ("vanilla",) for one attention call."""
    choices = kernel_choices()
    if choices is None:
        return _choose(options, dtype, cached, bias, dropout, window, jax.default_backend())
    kernel = _choose(options, dtype, cached, bias, dropout, window, choices.platform)
    choices.chosen.add(kernel)
    if kernel == ("fused", "cudnn") and jax.default_backend() != "gpu":
        return ("blockwise",)  # the stand-in (kernels_for)
    return kernel


def _choose(options, dtype, cached, bias, dropout, window, platform) -> tuple:
    backend = options.backend
    ours = ("blockwise",) if options.use_flash_attention or backend == "jax_flash" else ("vanilla",)
    if backend in ("vanilla", "jax_flash"):
        return ours
    if backend == "default":
        if platform != "gpu":
            if platform == "tpu":
                note_once("attention: TPU splash attention is not built here; the layers use ours (attn_backend)")
            return ours
        implementation = "cudnn"
    else:
        implementation = backend
    why = _unfit(options, dtype, cached, bias, dropout, window, implementation, platform)
    if why:
        note_once(f"attention: {implementation} cannot compute these layers ({why}); they use ours instead")
        return ours
    return ("fused", implementation)


def _unfit(options, dtype, cached, bias, dropout, window, implementation, platform) -> str | None:
    """Why the fused kernel would not compute exactly what ours does (None: it would)."""
    if cached:
        return "a KV cache"
    if bias or options.logits_soft_cap is not None:
        return "an additive bias or soft-capped scores"
    if dropout:
        return "dropout on the attention weights"
    if window is not None and not isinstance(window, int):
        return "per-layer sliding windows"
    if implementation == "cudnn":
        if platform != "gpu":
            return f"no NVIDIA GPU here (the backend is {platform})"
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return f"{jnp.dtype(dtype).name} compute; cuDNN's kernel needs bfloat16 or float16 (trainer.mp)"
        size = options.HeadSize.size
        if size % 8 or size > 128:
            return f"head size {size}; cuDNN's kernel needs a multiple of 8, at most 128"
    return None
