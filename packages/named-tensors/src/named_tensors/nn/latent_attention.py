"""Multi-head latent attention (DeepSeek-V2/V3): keys and values rebuilt from one small compressed latent per
position, plus a rotary key part shared by every head; a cache of those latents is all decoding needs.

Per position x: queries q = q_b(norm(q_a(x))) (or q_proj(x) without a query rank), axes (heads, head_size),
where head_size = qk_nope + qk_rope; the latent c = norm(kv_a(x)) (kv_lora) and the rotary key k_r = rope(k_rope(x))
(qk_rope, one for all heads). Then kv_b(c) gives each head its unrotated key part (qk_nope) and its value (v_head);
a head's key is [k_nope, k_r] and its query [q_nope, rope(q_rope)]. The cache holds c and k_r: kv_lora + qk_rope
numbers per position, instead of heads * (head_size + v_head).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .._core import Axis, NamedArray, broadcast_to, permute, rename
from .._creation import arange
from .._indexing import dynamic_update_slice
from .._reshape import concatenate, split
from .attention import dot_product_attention
from .linear import Linear
from .normalization import RMSNorm
from .rotary import RotaryEmbeddings

POSITION, KEY_POSITION = "position", "key_position"
HEAD_SIZE, QK_NOPE, QK_ROPE, V_HEAD, KV_LORA, Q_LORA, KV_HEAD = (
    "head_size", "qk_nope", "qk_rope", "v_head", "kv_lora", "q_lora", "kv_head",
)  # fmt: skip


class LatentCache(eqx.Module):
    """The decoding cache of latent attention: `latent` (..., key_position, kv_lora) and the rotated shared key
    `rope_key` (..., key_position, qk_rope); slot j holds position j."""

    latent: NamedArray
    rope_key: NamedArray

    @staticmethod
    def zeros(batch_axes: tuple[Axis, ...], KeyPos: Axis, KvLora: Axis, QkRope: Axis, *, dtype=jnp.float32):
        """An empty cache for one layer with room for KeyPos.size positions."""
        return LatentCache(
            NamedArray(jnp.zeros((*(a.size for a in batch_axes), KeyPos.size, KvLora.size), dtype),
                       (*batch_axes, KeyPos, KvLora)),
            NamedArray(jnp.zeros((*(a.size for a in batch_axes), KeyPos.size, QkRope.size), dtype),
                       (*batch_axes, KeyPos, QkRope)),
        )  # fmt: skip

    def write(self, latent: NamedArray, rope_key: NamedArray, offset) -> LatentCache:
        """The cache with new entries (axis key_position) stored from slot `offset` on."""
        return LatentCache(
            dynamic_update_slice(self.latent, latent.astype(self.latent.dtype), {KEY_POSITION: offset}),
            dynamic_update_slice(self.rope_key, rope_key.astype(self.rope_key.dtype), {KEY_POSITION: offset}),
        )


class LatentAttention(eqx.Module):
    """Causal multi-head latent attention; see the module docstring for the math.

    Layouts (each a PyTorch nn.Linear weight, (out, in)): `q_a_proj.weight` (q_lora, embed), `q_b_proj.weight`
    (heads, head_size, q_lora), or `q_proj.weight` (heads, head_size, embed) without a query rank;
    `kv_a_proj.weight` (kv_lora, embed), `k_rope_proj.weight` (qk_rope, embed), `kv_b_proj.weight`
    (heads, kv_head, kv_lora) where kv_head = qk_nope + v_head, `o_proj.weight` (embed, heads, v_head); the norms'
    weights (q_lora) and (kv_lora). Within head_size and kv_head the unrotated part comes first. With
    `interleave`, the rotary features are stored as interleaved pairs (x0, x1), (x2, x3), ... rather than in two
    halves (DeepSeek's own layout): they are reordered before rotating, which gives the same scores.
    """

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_norm: RMSNorm | None
    q_b_proj: Linear | None
    kv_a_proj: Linear
    k_rope_proj: Linear
    kv_a_norm: RMSNorm
    kv_b_proj: Linear
    o_proj: Linear
    rotary: RotaryEmbeddings = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    interleave: bool = eqx.field(static=True, default=False)
    dropout_rate: float = eqx.field(static=True, default=0.0)

    @staticmethod
    def init(
        Embed: Axis,
        Heads: Axis,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_dim: int,
        qk_rope_dim: int,
        v_head_dim: int,
        rotary: RotaryEmbeddings,
        key: jax.Array,
        scale: float | None = None,
        interleave: bool = False,
        use_bias: bool = False,
        norm_eps: float = 1e-6,
        dropout_rate: float = 0.0,
        init_scale: float = 0.02,
        dtype: DTypeLike = jnp.float32,
    ) -> LatentAttention:
        """Weights ~ Normal(0, init_scale), norms at one; `scale` of the scores defaults to 1/sqrt(head_size).

        use_bias puts biases on q_a_proj, kv_a_proj, k_rope_proj and o_proj (transformers' attention_bias)."""
        if rotary.head_size != qk_rope_dim:
            raise ValueError(f"LatentAttention: the rotary head size {rotary.head_size} must be qk_rope={qk_rope_dim}")
        for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_nope_dim", qk_nope_dim), ("v_head_dim", v_head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LatentAttention: {name} must be a positive int, got {value!r}")
        keys = jax.random.split(key, 7)
        HeadSize = Axis(HEAD_SIZE, qk_nope_dim + qk_rope_dim)
        KvLora = Axis(KV_LORA, kv_lora_rank)

        def linear(In, Out, k, bias=False) -> Linear:
            return Linear.init(In, Out, key=k, use_bias=bias, init_scale=init_scale, scale_by_fan_in=False, dtype=dtype)

        q_proj = q_a_proj = q_a_norm = q_b_proj = None
        if q_lora_rank is None:
            q_proj = linear(Embed, (Heads, HeadSize), keys[0])
        else:
            QLora = Axis(Q_LORA, q_lora_rank)
            q_a_proj = linear(Embed, QLora, keys[0], use_bias)
            q_a_norm = RMSNorm.init(QLora, eps=norm_eps, dtype=dtype)
            q_b_proj = linear(QLora, (Heads, HeadSize), keys[1])
        return LatentAttention(
            q_proj,
            q_a_proj,
            q_a_norm,
            q_b_proj,
            linear(Embed, KvLora, keys[2], use_bias),
            linear(Embed, Axis(QK_ROPE, qk_rope_dim), keys[3], use_bias),
            RMSNorm.init(KvLora, eps=norm_eps, dtype=dtype),
            linear(KvLora, (Heads, Axis(KV_HEAD, qk_nope_dim + v_head_dim)), keys[4]),
            linear((Heads, Axis(V_HEAD, v_head_dim)), Embed, keys[5], use_bias),
            rotary,
            float(scale if scale is not None else HeadSize.size**-0.5),
            interleave,
            dropout_rate,
        )

    @property
    def QkNope(self) -> Axis:
        return Axis(QK_NOPE, self.kv_b_proj.Out[1].size - self.o_proj.In[1].size)

    def __call__(
        self,
        x: NamedArray,
        positions: NamedArray,
        mask: NamedArray | None = None,
        *,
        cache: LatentCache | None = None,
        cache_offset: jax.Array | int = 0,
        key: jax.Array | None = None,
        inference: bool = False,
    ) -> tuple[NamedArray, LatentCache | None]:
        """Attend from every position of x (..., position, embed) to itself and earlier positions.

        `positions` are the queries' absolute positions (RoPE, and causality with a cache); `mask` (True = may
        attend, over position and key_position) is and-ed with the causal rule. With a cache, the new latents
        are written from slot `cache_offset` and the queries attend to the whole cache (slot j is position j).
        """
        QkRope = self.k_rope_proj.Out[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = split(q, HEAD_SIZE, [self.QkNope, QkRope])
        q_rope = self._rotate(q_rope, positions)
        latent = self.kv_a_norm(self.kv_a_proj(x))
        rope_key = self._rotate(self.k_rope_proj(x), positions)
        latent, rope_key = rename(latent, {POSITION: KEY_POSITION}), rename(rope_key, {POSITION: KEY_POSITION})
        key_positions = rename(positions, {POSITION: KEY_POSITION})
        new_cache = None
        if cache is not None:
            new_cache = cache.write(latent, rope_key, cache_offset)
            latent, rope_key = new_cache.latent.astype(q.dtype), new_cache.rope_key.astype(q.dtype)
            key_positions = arange(latent.resolve_axis(KEY_POSITION), dtype=jnp.int32)
        k_nope, v = split(self.kv_b_proj(latent), KV_HEAD, [self.QkNope, self.o_proj.In[1]])
        rope_key = broadcast_to(rope_key, tuple(QkRope if a.name == QK_NOPE else a for a in k_nope.axes))
        q = concatenate(HEAD_SIZE, [rename(q_nope, {QK_NOPE: HEAD_SIZE}), rename(q_rope, {QK_ROPE: HEAD_SIZE})])
        k = concatenate(HEAD_SIZE, [rename(k_nope, {QK_NOPE: HEAD_SIZE}), rename(rope_key, {QK_ROPE: HEAD_SIZE})])
        if cache is not None:
            visible = positions >= key_positions
            mask = visible if mask is None else visible & mask
        out = dot_product_attention(
            POSITION,
            KEY_POSITION,
            HEAD_SIZE,
            q,
            k,
            v,
            mask,
            scale=self.scale,
            causal=cache is None,
            dropout_rate=self.dropout_rate,
            dropout_key=key,
            inference=inference or key is None,
        )
        return self.o_proj(out), new_cache

    def _rotate(self, x: NamedArray, positions: NamedArray) -> NamedArray:
        """x's qk_rope features rotated by RoPE (first de-interleaved into two halves when `interleave`)."""
        if self.interleave:
            moved = permute(x, (..., QK_ROPE))
            halves = moved.array.reshape(*moved.array.shape[:-1], -1, 2)
            x = NamedArray(jnp.concatenate([halves[..., 0], halves[..., 1]], axis=-1), moved.axes)
        return self.rotary(x, positions, HeadSize=QK_ROPE)


__all__ = ["LatentAttention", "LatentCache"]
