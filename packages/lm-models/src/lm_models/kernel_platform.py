"""The platform the models choose their kernels for: jax's backend, or another one named with `kernels_for`.

Two choices depend on it: the attention kernel (`attn_backend: default` is cuDNN's fused kernel on an NVIDIA GPU)
and whether `next_token_loss` scores a large vocabulary in blocks (on a GPU or TPU). `lm-train plan` traces a
GPU's or TPU's step on a CPU under `kernels_for`, so that it counts the buffers those devices would hold.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import jax


@dataclass
class KernelChoices:
    """The platform kernels are chosen for, and the attention kernels chosen (and the notes on them) meanwhile."""

    platform: str
    chosen: set[tuple] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


_choices: ContextVar[KernelChoices | None] = ContextVar("kernels_for", default=None)


@contextlib.contextmanager
def kernels_for(platform: str) -> Iterator[KernelChoices]:
    """Choose kernels as on `platform` ("cpu", "gpu" or "tpu") rather than on the devices present.

    Yields what the attention layers chose, with their one-line notes kept there rather than shown. A fused
    kernel that cannot be traced here (cuDNN's, without an NVIDIA GPU) is traced as ours blockwise: the same
    inputs and output, and like it no (position, key_position) scores, so that a memory plan made here sees
    what those devices hold. Trace a new function inside it: jax reuses the trace of a function it has traced
    before at the same shapes, with the kernels chosen then.
    """
    choices = KernelChoices(platform)
    token = _choices.set(choices)
    try:
        yield choices
    finally:
        _choices.reset(token)


def kernel_choices() -> KernelChoices | None:
    """The choices being recorded under `kernels_for`, or None outside it."""
    return _choices.get()


def kernel_platform() -> str:
    """The platform kernels are chosen for: the one `kernels_for` names, else jax's default backend."""
    choices = _choices.get()
    return choices.platform if choices is not None else jax.default_backend()
