"""Causal self-attention shared by every family: q/k/v/o projections, RoPE or ALiBi, GQA, q/k norms, sliding
windows, soft-capping, and a KV cache (contiguous or paged)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray
from named_tensors.nn import Linear, RMSNorm
from named_tensors.nn.alibi import alibi_bias
from named_tensors.nn.rotary import rotate

from .attention_backend import AttentionCall, choose_kernel, takes_segment_ids
from .kv_cache import KEY_POSITION, KVCache
from .paged_cache import PagedKVCache

POSITION = "position"
# Queries (and keys) per block of blockwise attention when the config leaves the size unset.
DEFAULT_FLASH_BLOCK_SIZE = 128


@dataclass(frozen=True)
class AttentionOptions:
    """The static choices that distinguish the families' attention layers."""

    Embed: Axis
    Heads: Axis
    KVHeads: Axis
    HeadSize: Axis
    use_bias: bool
    upcast_softmax: bool = True
    dropout_rate: float = 0.0
    clip_qkv: float | None = None
    # nt.nn RotaryEmbeddings (a hashable, parameterless module) to rotate queries and keys, or None.
    rotary: Any = None
    # ALiBi's maximum bias (MPT's alibi_bias_max), or None for no ALiBi.
    alibi_max_bias: float | None = None
    use_flash_attention: bool = False
    flash_block_size: int | None = None
    # Which kernel computes attention (config.ATTN_BACKENDS); default: cuDNN's on NVIDIA GPUs, else ours.
    backend: str = "default"
    # The output projection's bias; None: the same as use_bias (Qwen 2 has q/k/v biases and none on o_proj).
    out_bias: bool | None = None
    # RMSNorm on queries and keys before RoPE: None, "head" (over head_size, per head: Qwen 3, Gemma 3) or
    # "all" (over heads and head_size together: OLMo 2), with this epsilon and weight offset (1 for Gemma).
    qk_norm: str | None = None
    qk_norm_eps: float = 1e-6
    qk_norm_offset: float = 0.0
    # The scores' scale; None: 1 / sqrt(head_size) (Gemma: query_pre_attn_scalar ** -0.5).
    scale: float | None = None
    # cap * tanh(scores / cap) on the scaled scores (Gemma 2), or None.
    logits_soft_cap: float | None = None
    # Keys visible to each query: its last `sliding_window` positions (itself included), or None for all.
    # Layers whose windows differ are given a per-layer `window` at call time instead.
    sliding_window: int | None = None
    # Then, the windows a layer's `window` can be (0: none), so that the fused kernels, whose window is static,
    # can be chosen among at run time; None: not known.
    layer_windows: tuple[int, ...] | None = None
    # RoPE of the layers that a per-layer `local` flag marks local (Gemma 3's other theta), or None.
    local_rotary: Any = None
    # A learned logit per head that joins each softmax (gpt-oss's attention sinks); only our plain kernel has them.
    sinks: bool = False
    # Llama 4, on the layers that use RoPE (every layer unless a per-layer `nope` flag says otherwise): keys only
    # in the query's chunk of `chunk_size` positions (None: no chunking; our plain kernel), and queries and keys
    # RMS-normalised without a weight after RoPE (`rope_qk_l2_norm`, epsilon qk_norm_eps).
    chunk_size: int | None = None
    rope_qk_l2_norm: bool = False
    # Llama 4's temperature tuning on the NoPE layers: queries times 1 + attn_scale * log1p(floor((position + 1)
    # / floor_scale)), given as (floor_scale, attn_scale); None: off.
    nope_temperature: tuple[float, float] | None = None

    @property
    def has_out_bias(self) -> bool:
        return self.use_bias if self.out_bias is None else self.out_bias

    @classmethod
    def of_config(cls, config: Any, **family: Any) -> AttentionOptions:
        """The options a config's axes and attention keys set, plus the family's own (`family`)."""
        return cls(
            Embed=config.Embed,
            Heads=config.Heads,
            KVHeads=config.KVHeads,
            HeadSize=config.HeadSize,
            upcast_softmax=config.upcast_attn,
            dropout_rate=config.attn_pdrop,
            use_flash_attention=config.use_flash_attention,
            flash_block_size=config.flash_attention_block_size,
            backend=config.attn_backend,
            **family,
        )


QK_NORMS = (None, "head", "all")


class Attention(eqx.Module):
    """Multi-head causal self-attention; with num_kv_heads < num_heads it is grouped-query attention.

    Layouts: `q_proj.weight` (heads, head_size, embed), `k_proj.weight` and `v_proj.weight`
    (kv_heads, head_size, embed), `o_proj.weight` (embed, heads, head_size); biases (when used) over the
    output axes of each projection.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    options: AttentionOptions = eqx.field(static=True)
    # RMSNorms of queries and keys (AttentionOptions.qk_norm), or None.
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    # The attention sinks (heads), when AttentionOptions.sinks.
    sinks: NamedArray | None = None

    @staticmethod
    def init(options: AttentionOptions, *, key: jax.Array, init_std: float, output_init_std: float) -> Attention:
        """Projections with weights ~ Normal(0, init_std); the output projection uses output_init_std."""
        kq, kk, kv, ko = jax.random.split(key, 4)
        o = options
        if o.qk_norm not in QK_NORMS:
            raise ValueError(f"AttentionOptions.qk_norm must be one of {list(QK_NORMS)}, got {o.qk_norm!r}")

        def linear(In, Out, k, std, bias=o.use_bias):
            return Linear.init(In, Out, key=k, use_bias=bias, init_scale=std, scale_by_fan_in=False)

        def norm(*axes: Axis) -> RMSNorm:
            return RMSNorm.init(axes, eps=o.qk_norm_eps, weight_offset=o.qk_norm_offset)

        q_norm = k_norm = None
        if o.qk_norm == "head":
            q_norm, k_norm = norm(o.HeadSize), norm(o.HeadSize)
        elif o.qk_norm == "all":
            q_norm, k_norm = norm(o.Heads, o.HeadSize), norm(o.KVHeads, o.HeadSize)
        sinks = None
        if o.sinks:
            sinks = nt.named(jax.random.normal(jax.random.fold_in(ko, 1), (o.Heads.size,)) * init_std, (o.Heads,))
        return Attention(
            linear(o.Embed, (o.Heads, o.HeadSize), kq, init_std),
            linear(o.Embed, (o.KVHeads, o.HeadSize), kk, init_std),
            linear(o.Embed, (o.KVHeads, o.HeadSize), kv, init_std),
            linear((o.Heads, o.HeadSize), o.Embed, ko, output_init_std, o.has_out_bias),
            options,
            q_norm,
            k_norm,
            sinks,
        )

    def __call__(
        self,
        x: NamedArray,
        mask: NamedArray | nt.nn.AttentionMask | None,
        positions: NamedArray,
        *,
        cache: KVCache | None = None,
        cache_offset: jax.Array | int = 0,
        query_scale: NamedArray | None = None,
        key: jax.Array | None = None,
        inference: bool = False,
        window: jax.Array | int | None = None,
        local: jax.Array | None = None,
        nope: jax.Array | None = None,
    ) -> tuple[NamedArray, KVCache | None]:
        """Attend from every position of x (axes ..., position, embed) to itself and earlier positions.

        `positions` holds the absolute position of each query (for RoPE, ALiBi and the causal mask); with a
        cache, new keys and values are written from slot `cache_offset` and the queries attend to the whole
        cache. `mask` (True = may attend) is and-ed with the causal rule; an nt.nn.AttentionMask keeps packed
        rows' segment ids apart, for the kernels that take them. `query_scale` (0-d) multiplies the scores
        (GPT-2's scale_attn_by_inverse_layer_idx). `window` (a traced 0-d int, <= 0 for none) is this layer's
        sliding window when layers differ; `local` (a traced 0-d bool) picks options.local_rotary over
        options.rotary for this layer. `nope` (a traced 0-d bool) marks a layer without RoPE (Llama 4's NoPE
        layers): no rotation, L2 norm or chunking there, and the temperature tuning instead.
        """
        o = self.options
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if o.clip_qkv is not None:
            q, k, v = (nt.clip(t, -o.clip_qkv, o.clip_qkv) for t in (q, k, v))
        if self.q_norm is not None:
            assert self.k_norm is not None  # Attention.init makes both norms or neither
            q, k = self.q_norm(q), self.k_norm(k)
        if o.rotary is not None:
            rq, rk = _rotate(o, q, positions, local), _rotate(o, k, positions, local)
            if o.rope_qk_l2_norm:
                rq, rk = _l2_norm(o, rq), _l2_norm(o, rk)
            # nt.where broadcasts a 0-d jax array condition; its annotation names only NamedArray and bool.
            q = rq if nope is None else nt.where(nope, q, rq)  # pyright: ignore[reportArgumentType]
            k = rk if nope is None else nt.where(nope, k, rk)  # pyright: ignore[reportArgumentType]
        if nope is not None and o.nope_temperature is not None:
            q = _temperature(o.nope_temperature, q, positions, nope)
        k = k.rename({POSITION: KEY_POSITION})
        v = v.rename({POSITION: KEY_POSITION})
        key_positions = positions.rename({POSITION: KEY_POSITION})
        new_cache = None
        if cache is not None:
            new_cache = cache.write(k, v, cache_offset)
            k, v, key_positions = new_cache.read()
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        bias = None
        if o.alibi_max_bias is not None:
            # MPT's key-only form: equal to the relative-distance bias under the causal mask, because a
            # constant per query row does not change the softmax; it also holds for a partly filled cache.
            KeyPos = k.resolve_axis(KEY_POSITION)
            bias = alibi_bias(o.Heads, KeyPos, max_bias=o.alibi_max_bias, dtype=jnp.float32)
        if query_scale is not None:
            q = q * query_scale.astype(q.dtype)
        if window is None:
            window = o.sliding_window
        common = {
            "scale": o.scale if o.scale is not None else 1.0 / (o.HeadSize.size**0.5),
            "dropout_rate": o.dropout_rate,
            "dropout_key": key,
            "inference": inference or key is None,
            "logits_soft_cap": o.logits_soft_cap,
        }
        dropout = o.dropout_rate > 0.0 and not common["inference"]
        cached = cache is not None
        segments, explicit = nt.nn.split_mask(mask)
        if cache is None and nt.nn.ring_mesh_axis(POSITION) is not None:
            # The positions are split over the mesh (context parallelism): the keys go round a ring.
            out = _ring(o, q, k, v, positions, key_positions, segments, explicit, bias, dropout, self.sinks, window)
            return self.o_proj(out), None
        call = AttentionCall(
            q.dtype, q.axis_size(POSITION), cached, bias is not None, dropout, explicit is not None, window
        )
        kernel = choose_kernel(o, call)
        if isinstance(cache, PagedKVCache) or self.sinks is not None or o.chunk_size is not None:
            # Each sequence of a paged batch sits at its own offset, sinks join the softmax, and chunks cut the
            # keys: only our plain kernel does any of these (GptOssConfig and Llama4Config refuse other backends).
            kernel = ("vanilla",)
        if segments is not None and not takes_segment_ids(kernel):
            assert isinstance(mask, nt.nn.AttentionMask)  # split_mask finds segment ids only in an AttentionMask
            # The kernel takes one (position, key_position) mask: build it from the ids.
            segments, explicit = None, mask.materialize(POSITION, KEY_POSITION)
        if kernel[0] == "fused":
            # ("fused", implementation): pyright does not narrow the ("vanilla",) above away on kernel[0].
            implementation = kernel[1]  # pyright: ignore[reportGeneralTypeIssues]
            out = _fused(implementation, o, q, k, v, explicit, segments, common["scale"], window)
        elif kernel[0] == "blockwise":
            # The causal rule and segment ids are applied per block, so no (position, key_position) mask is built.
            out = nt.nn.blockwise_attention(
                POSITION,
                KEY_POSITION,
                o.HeadSize,
                q,
                k,
                v,
                explicit,
                bias,
                causal=True,
                query_segment_ids=segments,
                key_segment_ids=None if segments is None else segments.rename({POSITION: KEY_POSITION}),
                causal_offset=cache_offset if cache is not None else 0,
                block_size=o.flash_block_size or DEFAULT_FLASH_BLOCK_SIZE,
                sliding_window=window,
                **common,
            )
        else:
            # Without a cache, causality by index, as in the other kernels: dot_product_attention then skips the
            # blocks of keys that no query in a block sees. With one, by position (the queries sit at an offset).
            visible = None if cache is None else positions >= key_positions
            if window is not None:
                in_window = _in_window(positions, key_positions, window)
                visible = in_window if visible is None else visible & in_window
            chunk = nt.nn.chunked_mask(positions, key_positions, o.chunk_size)
            if chunk is not None:
                if nope is not None:  # the NoPE layers attend to every earlier key
                    chunk = NamedArray(jnp.logical_or(chunk.array, nope), chunk.axes)
                visible = chunk if visible is None else visible & chunk
            if visible is not None:
                explicit = visible if explicit is None else visible & explicit
            out = nt.nn.dot_product_attention(
                POSITION,
                KEY_POSITION,
                o.HeadSize,
                q,
                k,
                v,
                explicit,
                bias,
                upcast_softmax=o.upcast_softmax,
                causal=cache is None,
                sinks=self.sinks,
                **common,
            )
        if isinstance(new_cache, PagedKVCache):
            # The pool stays out of the layer stack's outputs (see PagedKVCache); as it came in, a paged cache
            # stands in for a KVCache.
            new_cache = cast(KVCache, new_cache.handed_back())
        return self.o_proj(out), new_cache


def _fused(implementation: str, o: AttentionOptions, q, k, v, mask, segments, scale: float, window) -> NamedArray:
    """A fused kernel's attention; a per-layer (traced) window picks, at run time, the kernel built for it."""
    if window is not None and not isinstance(window, int):
        windows = o.layer_windows  # known: choose_kernel's _unfit sends other per-layer windows to ours
        assert windows is not None
        index = jnp.argmax(jnp.asarray(windows, jnp.int32) == jnp.asarray(window, jnp.int32))
        branches = [
            lambda *xs, w=w: _fused(implementation, o, *xs, scale=scale, window=w if w > 0 else None) for w in windows
        ]
        return jax.lax.switch(index, branches, q, k, v, mask, segments)
    if implementation == "splash":
        # Causal (and a static window) by index, as below; segment ids and soft-capping, but no mask (_unfit).
        return nt.nn.splash_attention(
            POSITION, KEY_POSITION, o.HeadSize, q, k, v, scale=scale, sliding_window=window, segment_ids=segments,
            logits_soft_cap=o.logits_soft_cap,
        )  # fmt: skip
    # Causality (and a static window) by index: in training the positions grow along each sequence, and a packed
    # row's documents are kept apart by the mask.
    return nt.nn.fused_attention(
        POSITION, KEY_POSITION, o.HeadSize, q, k, v, mask, scale=scale, causal=True, sliding_window=window,
        implementation=implementation,
    )  # fmt: skip


def _ring(o: AttentionOptions, q, k, v, positions, key_positions, segments, explicit, bias, dropout, sinks, window):
    """Ring attention (nt.nn.ring_attention) when the axis mapping splits the positions over a mesh axis."""
    refused = [
        name
        for name, used in (
            ("an explicit attention mask (forgetful causal masking, a prefix)", explicit is not None),
            ("ALiBi", bias is not None),
            ("attention dropout (attn_pdrop)", dropout),
            ("attention sinks", sinks is not None),
            ("chunked attention (attention_chunk_size)", o.chunk_size is not None),
        )
        if used
    ]
    if refused:
        raise ValueError(
            f"context parallelism (ring attention) does not take {', '.join(refused)}: set "
            "trainer.context_axis_size to 1 for this model, or turn these off"
        )
    return nt.nn.ring_attention(
        POSITION, KEY_POSITION, o.HeadSize, q, k, v, query_positions=positions, key_positions=key_positions,
        query_segment_ids=segments, key_segment_ids=None if segments is None else segments.rename(
            {POSITION: KEY_POSITION}), sliding_window=window, scale=o.scale if o.scale is not None else
        1.0 / (o.HeadSize.size**0.5), logits_soft_cap=o.logits_soft_cap,
    )  # fmt: skip


def _l2_norm(o: AttentionOptions, x: NamedArray) -> NamedArray:
    """x / sqrt(mean(x²) + eps) over head_size, in float32, with no weight (transformers' Llama4TextL2Norm)."""
    return RMSNorm(None, (o.HeadSize,), o.qk_norm_eps, True)(x)


def _temperature(
    floor_and_scale: tuple[float, float], q: NamedArray, positions: NamedArray, nope: jax.Array
) -> NamedArray:
    """Queries of a NoPE layer times 1 + attn_scale * log1p(floor((position + 1) / floor_scale)), in float32."""
    floor_scale, attn_scale = floor_and_scale
    pos = positions.array.astype(jnp.float32)
    scale = jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
    scale = NamedArray(jnp.where(nope, scale, 1.0), positions.axes)
    return (q.astype(jnp.float32) * scale).astype(q.dtype)


def _in_window(positions: NamedArray, key_positions: NamedArray, window: jax.Array | int) -> NamedArray:
    """Keys among the last `window` positions up to each query (all keys when window <= 0)."""
    window = jnp.asarray(window, jnp.int32)
    return (key_positions > positions - window) | (window <= 0)


def _rotate(o: AttentionOptions, x: NamedArray, positions: NamedArray, local: jax.Array | None) -> NamedArray:
    """x rotated by the layer's RoPE: options.rotary, or options.local_rotary where `local` is set."""
    if o.local_rotary is None or local is None:
        return o.rotary(x, positions)
    cos, sin = o.rotary.cos_sin(positions)
    cos_local, sin_local = o.local_rotary.cos_sin(positions)
    local = jnp.asarray(local, jnp.bool_)
    # nt.where broadcasts a 0-d jax array condition; its annotation names only NamedArray and bool.
    return rotate(x, nt.where(local, cos_local, cos), nt.where(local, sin_local, sin))  # pyright: ignore[reportArgumentType]
