"""Plain-JAX references for bench/train_step.py's Llama-style and Mixtral-style rows (no named tensors, no equinox).

The same math as lm_models' Llama and Mixtral (DecoderLMHeadModel, Mixtral's with a mixture of experts): RMSNorm,
rotate-half RoPE, grouped-query causal softmax attention, a SwiGLU MLP or Mixtral's top-k router with renormalised
weights and gated experts, untied head, mean next-token cross-entropy; layers run by `lax.scan`. The experts are
dispatched the way named_tensors.nn.moe does it (sort the k choices by expert, pad each expert's run to whole
blocks, one matmul per block, skip empty blocks), written here on plain arrays. `ideal_dispatch=True` instead
gives each expert an equal, contiguous share of the token copies (no routing data movement, the same matmul
FLOPs): the difference between the two step times is the dispatch's cost.

Parameters are our model's, flattened to {path: array} with axes in one canonical order, so that the reference
reads exactly the weights ours starts from.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

import named_tensors as nt

AXIS_ORDER = ("layers", "experts", "vocab", "embed", "heads", "kv_heads", "head_size", "mlp")


def flat_params(tree: Any) -> dict[str, jax.Array]:
    """{path: array} of the NamedArray leaves (or plain leaves of a mask), axes in AXIS_ORDER."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=nt.is_named)[0]:
        key = jax.tree_util.keystr(path, simple=True, separator=".")
        if isinstance(leaf, nt.NamedArray):
            order = sorted(leaf.axis_names, key=AXIS_ORDER.index)
            leaf = jnp.array(nt.permute(leaf, order).array, copy=True)  # ours is donated: copy
        out[key] = leaf
    return out


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """x (batch, position, heads, head_size) rotated as Hugging Face's Llama (rotate_half)."""
    T, D = x.shape[1], x.shape[-1]
    inv = 1.0 / (jnp.float32(theta) ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    angles = jnp.arange(T, dtype=jnp.float32)[:, None] * inv[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    half = D // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def _attention(h: jax.Array, w: dict[str, jax.Array], theta: float) -> jax.Array:
    q = jnp.einsum("bte,ehd->bthd", h, w["self_attn.q_proj.weight"])
    k = jnp.einsum("bte,ehd->bthd", h, w["self_attn.k_proj.weight"])
    v = jnp.einsum("bte,ehd->bthd", h, w["self_attn.v_proj.weight"])
    q, k = _rope(q, theta), _rope(k, theta)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    T = h.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return jnp.einsum("bthd,ehd->bte", out, w["self_attn.o_proj.weight"])


def _swiglu(h: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """gate/up (..., embed, mlp), down (..., embed, mlp): down(silu(h gate) * h up)."""
    return (jax.nn.silu(h @ gate) * (h @ up)) @ down.T


def _moe(x: jax.Array, w: dict[str, jax.Array], k: int, block_size: int, ideal: bool) -> jax.Array:
    """Mixtral's sparse MoE on tokens x (T, H)."""
    gate, up, down = w["mlp.experts.gate"], w["mlp.experts.up"], w["mlp.experts.down"]  # (E, H, I) x3
    E, T, H = gate.shape[0], x.shape[0], x.shape[1]
    logits = x @ w["mlp.router.weight"].T
    top, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), k)
    weights = (top / top.sum(-1, keepdims=True)).astype(x.dtype)
    A = T * k
    if ideal:  # an equal contiguous share of the token copies per expert: the matmuls without the dispatch
        rows = jnp.repeat(x, k, axis=0).reshape(E, A // E, H)
        y = jax.vmap(_swiglu)(rows, gate, up, down).reshape(T, k, H)
        return jnp.sum(y * weights[..., None], axis=1)
    B = max(1, min(block_size, -(-A // E)))
    n_blocks = -(-(A + E * (B - 1)) // B)
    group = ids.reshape(A)
    order = jnp.argsort(group, stable=True)
    group_sorted, token = group[order], order // k
    counts = jnp.zeros(E, jnp.int32).at[group].add(1)
    starts = jnp.cumsum(counts) - counts
    padded = (counts + B - 1) // B * B
    padded_ends = jnp.cumsum(padded)
    dest = padded_ends[group_sorted] - padded[group_sorted] + jnp.arange(A, dtype=jnp.int32) - starts[group_sorted]
    rows = jnp.zeros((n_blocks * B, H), x.dtype).at[dest].set(x[token], unique_indices=True)
    block_starts = jnp.arange(n_blocks, dtype=jnp.int32) * B
    block_expert = jnp.minimum(jnp.searchsorted(padded_ends, block_starts, side="right"), E - 1)

    def one_block(_, xs):
        rows_b, e, start = xs
        out = jax.lax.cond(
            start < padded_ends[-1], lambda r: _swiglu(r, gate[e], up[e], down[e]), jnp.zeros_like, rows_b
        )
        return None, out

    _, out = jax.lax.scan(one_block, None, (rows.reshape(n_blocks, B, H), block_expert, block_starts))
    y = out.reshape(n_blocks * B, H)[dest]
    return jnp.zeros((T, H), x.dtype).at[token].add(y * weights.reshape(A)[order][:, None])


def make_loss(family: str, config: Any, compute_dtype: Any, *, ideal_dispatch: bool = False):
    """The plain-JAX next-token loss of (params, ids[batch, seq]) for our Llama or Mixtral config."""
    eps, theta = config.layer_norm_epsilon, config.rope.theta
    moe = family == "mixtral"
    prefix = "blocks.stacked."

    def block(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
        x = x + _attention(_rms(x, w["pre_attn_norm.weight"], eps), w, theta)
        h = _rms(x, w["pre_mlp_norm.weight"], eps)
        if moe:
            B, T, H = h.shape
            k, block_size = config.num_experts_per_tok, config.moe_block_size
            return x + _moe(h.reshape(B * T, H), w, k, block_size, ideal_dispatch).reshape(B, T, H)
        return x + _swiglu(h, w["mlp.gate.weight"], w["mlp.up.weight"], w["mlp.down.weight"])

    def loss(params: dict[str, Any], ids: jax.Array) -> jax.Array:
        p = jax.tree_util.tree_map(lambda t: t.astype(compute_dtype), params)
        layers = {name[len(prefix) :]: v for name, v in p.items() if name.startswith(prefix)}
        x = p["embed_tokens.weight"][ids]
        x, _ = jax.lax.scan(lambda carry, w: (block(carry, w), None), x, layers)
        h = _rms(x, p["norm.weight"], eps)
        logits = (h @ p["lm_head.weight"].T).astype(jnp.float32)
        targets = jnp.roll(ids, -1, axis=1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return (jax.nn.logsumexp(logits, axis=-1) - picked)[:, :-1].mean()

    return loss


def check_balanced(config: Any, tokens: int) -> None:
    """The ideal dispatch needs the token copies to split evenly over the experts."""
    copies = tokens * config.num_experts_per_tok
    if copies % config.n_routed_experts:
        raise SystemExit(f"{copies} token copies do not split over {config.n_routed_experts} experts")


__all__ = ["check_balanced", "flat_params", "make_loss"]
