"""Blockwise (flash-style) attention on positional arrays, with a custom VJP that recomputes blocks.

Layout: q (*S, R, Tq, D), k (*S, Tk, D), v (*S, Tk, Dv); S are the dimensions shared by queries and
keys (batch, kv heads: kept separate, so that each keeps its sharding), R the query-only dimension
(query heads per kv head). Tq and Tk are multiples of the block sizes (the caller pads); keys at index
>= key_length are padding and never attended.

Masking inputs (`Extras`), each optional, with size 1 wherever they do not vary: `mask` (bool) and
`bias` (float) of shape (*S, R, Tq, Tk); segment ids of shape (*S, R, Tq) for queries and (*S, Tk) for
keys; `offset`, the position of query 0 among the keys for the causal rule k <= q + offset; and, with
the causal rule, `prefix_length` of shape (*S, R): keys k < prefix_length are visible to every query
(prefix-LM), or `window` (a 0-d int32, possibly traced): only keys k > q + offset - window are visible (sliding
window; window <= 0 means no limit), and key blocks outside every window are skipped. `FlashConfig.soft_cap`
squashes the scaled scores with cap * tanh(s / cap) before the bias (Gemma 2). With a dropout rate,
`dropout_key` draws the keep mask of block (i, j) from
fold_in(fold_in(key, i), j), so the backward pass redraws exactly the forward's mask.

Memory: the forward pass holds one (*S, R, bq, bk) block of scores at a time plus per-row statistics;
the backward pass recomputes the blocks from q, k, v and the saved row logsumexp, so it too is linear in
sequence length (plus the size of the bias, whose cotangent it accumulates). Fully masked rows produce zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Extras(NamedTuple):
    """Masking inputs (see the module docstring); of these only the bias gets a gradient."""

    mask: jax.Array | None
    bias: jax.Array | None
    query_segment_ids: jax.Array | None
    key_segment_ids: jax.Array | None
    offset: jax.Array
    prefix_length: jax.Array | None = None
    dropout_key: jax.Array | None = None
    window: jax.Array | None = None


@dataclass(frozen=True)
class FlashConfig:
    """Static settings of one blockwise attention call."""

    causal: bool
    scale: float
    query_block: int
    key_block: int
    key_length: int
    precision: jax.lax.PrecisionLike = None
    dropout_rate: float = 0.0
    soft_cap: float | None = None


def _slice(x: jax.Array, axis: int, start, size: int) -> jax.Array:
    """Block [start, start+size) along axis (negative axes count from the end)."""
    return lax.dynamic_slice_in_dim(x, start, size, axis % x.ndim)


def _take(x: jax.Array, axis: int, start, size: int) -> jax.Array:
    """Block [start, start+size) along axis, or x itself where that axis is broadcast (size 1)."""
    if x.shape[axis] == 1:
        return x
    return _slice(x, axis, start, size)


def _block_scores(q_blk, k_blk, i, j, extras: Extras, cfg: FlashConfig):
    """float32 scores (*S, R, bq, bk) of query block i against key block j, where attending is allowed, and the
    derivative of the soft cap at each score (None without a cap)."""
    bq, bk = cfg.query_block, cfg.key_block
    lead = q_blk.ndim - 2  # the S dimensions and R
    s = jnp.einsum("...rqd,...kd->...rqk", q_blk, k_blk, precision=cfg.precision, preferred_element_type=jnp.float32)
    s = s * cfg.scale
    cap_grad = None
    if cfg.soft_cap is not None:
        t = jnp.tanh(s / cfg.soft_cap)
        s, cap_grad = t * cfg.soft_cap, 1.0 - t * t
    q_idx = i * bq + jnp.arange(bq, dtype=jnp.int32)
    k_idx = (j * bk + jnp.arange(bk, dtype=jnp.int32)).reshape((1,) * (lead + 1) + (bk,))
    allowed = k_idx < cfg.key_length
    if cfg.causal:
        visible = k_idx <= q_idx.reshape((1,) * lead + (bq, 1)) + extras.offset
        if extras.prefix_length is not None:
            visible = visible | (k_idx < extras.prefix_length[..., None, None])
        if extras.window is not None:
            in_window = k_idx > q_idx.reshape((1,) * lead + (bq, 1)) + extras.offset - extras.window
            visible = visible & (in_window | (extras.window <= 0))
        allowed = allowed & visible
    if extras.mask is not None:
        allowed = allowed & _take(_take(extras.mask, -2, i * bq, bq), -1, j * bk, bk)
    if extras.query_segment_ids is not None:
        q_seg = _take(extras.query_segment_ids, -1, i * bq, bq)[..., None]
        assert extras.key_segment_ids is not None  # given with the query's ids, or not at all
        k_seg = _take(extras.key_segment_ids, -1, j * bk, bk)[..., None, None, :]
        allowed = allowed & (q_seg == k_seg)
    if extras.bias is not None:
        s = s + _take(_take(extras.bias, -2, i * bq, bq), -1, j * bk, bk).astype(jnp.float32)
    return s, allowed, cap_grad


def _dropout_keep(i, j, shape, extras: Extras, cfg: FlashConfig) -> jax.Array:
    """The keep mask of block (i, j): the same in the forward and the backward pass."""
    assert extras.dropout_key is not None  # dropout is on only with a key
    key = jax.random.fold_in(jax.random.fold_in(extras.dropout_key, i), j)
    return jax.random.bernoulli(key, 1.0 - cfg.dropout_rate, shape)


def _add_bias_cotangent(d_bias, d_scores, i, j, cfg: FlashConfig):
    """Add block (i, j)'s score cotangent to the bias cotangent, summed over the dims the bias broadcasts."""
    if d_bias is None:
        return None
    broadcast = tuple(ax for ax in range(d_scores.ndim) if d_bias.shape[ax] == 1 and d_scores.shape[ax] != 1)
    block = jnp.sum(d_scores, axis=broadcast, keepdims=True)
    start = [jnp.int32(0)] * d_bias.ndim
    if d_bias.shape[-2] != 1:
        start[-2] = jnp.asarray(i * cfg.query_block, jnp.int32)
    if d_bias.shape[-1] != 1:
        start[-1] = jnp.asarray(j * cfg.key_block, jnp.int32)
    return lax.dynamic_update_slice(d_bias, lax.dynamic_slice(d_bias, start, block.shape) + block, start)


def _first_key_block_in_window(i, extras: Extras, cfg: FlashConfig):
    """Index of the first key block that query block i can see (0 without a sliding window)."""
    if not cfg.causal or extras.window is None:
        return 0
    first_key = i * cfg.query_block + extras.offset - extras.window + 1
    return jnp.where(extras.window > 0, jnp.maximum(first_key, 0) // cfg.key_block, 0)


def _last_query_block_seeing(j, extras: Extras, cfg: FlashConfig, n_query_blocks: int):
    """One past the last query block that can see key block j (all of them without a sliding window)."""
    if not cfg.causal or extras.window is None:
        return n_query_blocks
    last_query = (j + 1) * cfg.key_block - 1 - extras.offset + extras.window - 1
    bound = jnp.clip(last_query // cfg.query_block + 1, 0, n_query_blocks)
    return jnp.where(extras.window > 0, bound, n_query_blocks)


def _first_key_block_after(i, extras: Extras, cfg: FlashConfig, n_key_blocks: int):
    """Number of key blocks that query block i can see (all of them unless causal)."""
    if not cfg.causal:
        return n_key_blocks
    last_key = (i + 1) * cfg.query_block - 1 + extras.offset
    if extras.prefix_length is not None:
        last_key = jnp.maximum(last_key, jnp.max(extras.prefix_length) - 1)
    return jnp.clip(last_key // cfg.key_block + 1, 0, n_key_blocks)


def _first_query_block_seeing(j, extras: Extras, cfg: FlashConfig, n_query_blocks: int):
    """Index of the first query block that can see key block j (0 unless causal)."""
    if not cfg.causal:
        return 0
    first = jnp.clip((j * cfg.key_block - extras.offset) // cfg.query_block, 0, n_query_blocks)
    if extras.prefix_length is not None:
        first = jnp.where(j * cfg.key_block < jnp.max(extras.prefix_length), 0, first)
    return first


def _forward(q, k, v, extras: Extras, cfg: FlashConfig):
    rows, Tq, Dv = q.shape[:-2], q.shape[-2], v.shape[-1]
    bq, bk = cfg.query_block, cfg.key_block
    n_key_blocks = k.shape[-2] // bk

    def query_block(i):
        q_blk = _slice(q, -2, i * bq, bq)

        def key_step(j, carry):
            row_max, row_sum, acc = carry
            k_blk = _slice(k, -2, j * bk, bk)
            v_blk = _slice(v, -2, j * bk, bk)
            s, allowed, _ = _block_scores(q_blk, k_blk, i, j, extras, cfg)
            s = jnp.where(allowed, s, -jnp.inf)
            new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
            # Rows with nothing allowed yet keep max -inf; shift them by 0 so that exp never sees inf - inf.
            shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
            correction = jnp.exp(row_max - shift)
            p = jnp.exp(s - shift[..., None])
            row_sum = row_sum * correction + jnp.sum(p, axis=-1)
            if cfg.dropout_rate:
                # The normaliser uses every weight; only the weighted sum of values sees the dropout.
                keep = _dropout_keep(i, j, p.shape, extras, cfg)
                p = jnp.where(keep, p / (1.0 - cfg.dropout_rate), 0.0)
            pv = jnp.einsum(
                "...rqk,...kd->...rqd",
                p.astype(v.dtype),
                v_blk,
                precision=cfg.precision,
                preferred_element_type=jnp.float32,
            )
            return new_max, row_sum, acc * correction[..., None] + pv

        init = (
            jnp.full((*rows, bq), -jnp.inf, jnp.float32),
            jnp.zeros((*rows, bq), jnp.float32),
            jnp.zeros((*rows, bq, Dv), jnp.float32),
        )
        first, stop = _first_key_block_in_window(i, extras, cfg), _first_key_block_after(i, extras, cfg, n_key_blocks)
        row_max, row_sum, acc = lax.fori_loop(first, stop, key_step, init)
        seen = row_sum > 0
        out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
        lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), 0.0)
        return out.astype(v.dtype), lse

    out, lse = lax.map(query_block, jnp.arange(Tq // bq))
    # lax.map stacks the query blocks in front: move them next to the rows of each block, then merge.
    out = jnp.moveaxis(out, 0, -3).reshape(*rows, Tq, Dv)
    lse = jnp.moveaxis(lse, 0, -2).reshape(*rows, Tq)
    return out, lse


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash_attention(q, k, v, extras: Extras, cfg: FlashConfig):
    """Attention output (*S, R, Tq, Dv) in v's dtype; see the module docstring."""
    return _forward(q, k, v, extras, cfg)[0]


def _flash_fwd(q, k, v, extras: Extras, cfg: FlashConfig):
    out, lse = _forward(q, k, v, extras, cfg)
    return out, (q, k, v, extras, out, lse)


def _flash_bwd(cfg: FlashConfig, residuals, d_out):
    q, k, v, extras, out, lse = residuals
    bq, bk = cfg.query_block, cfg.key_block
    n_query_blocks, n_key_blocks = q.shape[-2] // bq, k.shape[-2] // bk
    f32 = jnp.float32
    d_out = d_out.astype(f32)
    # delta_i = sum_d dO_id * O_id = sum_k P_ik dP_ik: the softmax backward's row term, computed once.
    delta = jnp.sum(d_out * out.astype(f32), axis=-1)

    def key_block(j, carry):
        d_q, d_k, d_v, d_bias = carry
        k_blk = _slice(k, -2, j * bk, bk)
        v_blk = _slice(v, -2, j * bk, bk).astype(f32)

        def query_step(i, inner):
            d_q, d_k_blk, d_v_blk, d_bias = inner
            q_blk = _slice(q, -2, i * bq, bq)
            d_out_blk = _slice(d_out, -2, i * bq, bq)
            lse_blk = _slice(lse, -1, i * bq, bq)
            delta_blk = _slice(delta, -1, i * bq, bq)
            s, allowed, cap_grad = _block_scores(q_blk, k_blk, i, j, extras, cfg)
            p = jnp.where(allowed, jnp.exp(s - lse_blk[..., None]), 0.0)
            kept = p
            if cfg.dropout_rate:
                keep = _dropout_keep(i, j, p.shape, extras, cfg)
                kept = jnp.where(keep, p / (1.0 - cfg.dropout_rate), 0.0)
            d_v_blk = d_v_blk + jnp.einsum("...rqk,...rqd->...kd", kept, d_out_blk, precision=cfg.precision)
            d_p = jnp.einsum("...rqd,...kd->...rqk", d_out_blk, v_blk, precision=cfg.precision)
            if cfg.dropout_rate:
                d_p = jnp.where(keep, d_p / (1.0 - cfg.dropout_rate), 0.0)
            # delta = rowsum(dO * O) still equals sum_k P dP with the dropped output O (FlashAttention-2).
            d_scores = p * (d_p - delta_blk[..., None])
            d_bias = _add_bias_cotangent(d_bias, d_scores, i, j, cfg)
            d_s = d_scores * cfg.scale if cap_grad is None else d_scores * cap_grad * cfg.scale
            d_q_blk = jnp.einsum("...rqk,...kd->...rqd", d_s, k_blk.astype(f32), precision=cfg.precision)
            d_q = lax.dynamic_update_slice_in_dim(d_q, _slice(d_q, -2, i * bq, bq) + d_q_blk, i * bq, d_q.ndim - 2)
            d_k_blk = d_k_blk + jnp.einsum("...rqk,...rqd->...kd", d_s, q_blk.astype(f32), precision=cfg.precision)
            return d_q, d_k_blk, d_v_blk, d_bias

        zeros_k = jnp.zeros(k_blk.shape, f32)
        zeros_v = jnp.zeros(v_blk.shape, f32)
        d_q, d_k_blk, d_v_blk, d_bias = lax.fori_loop(
            _first_query_block_seeing(j, extras, cfg, n_query_blocks),
            _last_query_block_seeing(j, extras, cfg, n_query_blocks),
            query_step,
            (d_q, zeros_k, zeros_v, d_bias),
        )
        d_k = lax.dynamic_update_slice_in_dim(d_k, d_k_blk, j * bk, d_k.ndim - 2)
        d_v = lax.dynamic_update_slice_in_dim(d_v, d_v_blk, j * bk, d_v.ndim - 2)
        return d_q, d_k, d_v, d_bias

    d_bias = None if extras.bias is None else jnp.zeros(extras.bias.shape, f32)
    init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32), d_bias)
    d_q, d_k, d_v, d_bias = lax.fori_loop(0, n_key_blocks, key_block, init)
    # Only the bias among the extras is differentiable; None stands for the others' zero cotangents.
    d_bias = None if extras.bias is None or d_bias is None else d_bias.astype(extras.bias.dtype)
    # `offset` is not differentiable: None is jax's "zero cotangent" there, though the field's type is an Array.
    d_extras = Extras(None, d_bias, None, None, None)  # pyright: ignore[reportArgumentType]
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_extras


flash_attention.defvjp(_flash_fwd, _flash_bwd)
