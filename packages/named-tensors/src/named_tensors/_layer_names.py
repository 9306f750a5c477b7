"""Names and defaults of the layers that configs check against without importing jax (named_tensors.nn uses
them)."""

ACTIVATION_NAMES: tuple[str, ...] = (
    "gelu",
    "gelu_new",
    "gelu_pytorch_tanh",
    "quick_gelu",
    "relu",
    "sigmoid",
    "silu",
    "swish",
    "tanh",
)
"""The `activation_function` names activation_fn knows (Hugging Face's `hidden_act` names)."""

DEFAULT_MOE_BLOCK_SIZE = 128
"""Tokens per block of the mixture-of-experts layers' grouped matmul."""
