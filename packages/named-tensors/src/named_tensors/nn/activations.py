"""Activation functions looked up by the names Hugging Face configs use (`hidden_act`)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from .._core import NamedArray
from .._layer_names import ACTIVATION_NAMES


def _quick_gelu(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(1.702 * x)


# "gelu" is the exact (erf) GELU as in Hugging Face; GPT-2's tanh approximation is "gelu_new".
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": _quick_gelu,
    "tanh": jax.numpy.tanh,
    "sigmoid": jax.nn.sigmoid,
}


def activation_fn(name: str) -> Callable[[NamedArray], NamedArray]:
    """The elementwise activation called `name` (one of ACTIVATION_NAMES), acting on NamedArrays."""
    try:
        fn = _ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown activation {name!r}; choose one of {list(ACTIVATION_NAMES)}") from None

    def apply(x: NamedArray) -> NamedArray:
        return NamedArray(fn(x.array), x.axes)

    apply.__name__ = name
    return apply
