"""Model FLOPs per token for MFU: 6 x (matmul weights per token) plus the attention score and mix products.

The count, per token and for one training step (forward + backward = 3 x forward):

    forward = 2 * (matmul weights touched per token) + 4 * num_layers * seq_len * num_heads * head_size
    training = 3 * forward

Matmul weights are the q/k/v/o projections, the MLP matrices (two, or three for gated MLPs) and the
output head; embedding lookups, norms and biases are not counted (they are not matmuls). The attention
term counts q·k and the weighted sum of v over the full key length (causal masking is not subtracted),
which is the usual convention for MFU so that numbers compare across codebases.
"""

from __future__ import annotations

from typing import Any


def attention_flops_per_token(*, num_layers: int, seq_len: int, num_heads: int, head_size: int) -> float:
    """Forward FLOPs per token of the q·k scores and the score-weighted sum of v, over all layers."""
    return 4.0 * num_layers * seq_len * num_heads * head_size


def transformer_matmul_weights(
    *,
    hidden_dim: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    mlp_dim: int,
    mlp_matrices: int,
    vocab_size: int,
) -> int:
    """Matmul weights that every token multiplies through: attention and MLP projections plus the head."""
    q_and_o = 2 * hidden_dim * num_heads * head_size
    k_and_v = 2 * hidden_dim * num_kv_heads * head_size
    mlp = mlp_matrices * hidden_dim * mlp_dim
    return num_layers * (q_and_o + k_and_v + mlp) + hidden_dim * vocab_size


def training_flops_per_token(matmul_weights: float, attention_forward_flops: float) -> float:
    """Forward + backward FLOPs per token: three times (2 x weights + attention)."""
    return 3.0 * (2.0 * matmul_weights + attention_forward_flops)


def config_matmul_weights(config: Any, vocab_size: int, *, num_kv_heads: int, mlp_matrices: int) -> int:
    """transformer_matmul_weights with a config's hidden_dim, num_layers, num_heads, HeadSize and Mlp."""
    return transformer_matmul_weights(
        hidden_dim=config.hidden_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=num_kv_heads,
        head_size=config.HeadSize.size,
        mlp_dim=config.Mlp.size,
        mlp_matrices=mlp_matrices,
        vocab_size=vocab_size,
    )


def mha_flops_per_token(config: Any, vocab_size: int, seq_len: int | None = None) -> float:
    """Training FLOPs per token of a multi-head config with a two-matrix MLP and a tied head (GPT-2, MPT)."""
    weights = config_matmul_weights(config, vocab_size, num_kv_heads=config.num_heads, mlp_matrices=2)
    attention = attention_flops_per_token(
        num_layers=config.num_layers,
        seq_len=seq_len or config.seq_len,
        num_heads=config.num_heads,
        head_size=config.HeadSize.size,
    )
    return training_flops_per_token(weights, attention)
