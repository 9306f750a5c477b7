"""Quantized matmuls for Linear layers: fp8 (e4m3 forward, e5m2 gradients, per-tensor scales) and int8.

fp8 follows Transformer Engine's recipe. The forward quantizes the input and the weight to float8_e4m3fn, each
with one scale per tensor (scale = amax / 448, values saturate at the format's range), multiplies them with f32
accumulation and rescales; the backward quantizes the output's cotangent to float8_e5m2 (its wider range suits
gradients) and forms both gradients from it and the forward's quantized operands. The quantization counts as
the identity in the gradient (straight-through). Scaling is either *current* (each tensor's amax of this call)
or *delayed* (the max over an amax history of the last steps, kept beside the weight; a history that has seen
nothing yet falls back to the current amax). Delayed scaling is what lets a fused kernel quantize without a
pass over the tensor first; on CPU the two only differ in numbers.

A delayed layer's histories are arrays of the model but no parameters: the call hands each one back as the
"gradient" of its history (the amax it saw, in every slot), `split_amax` takes those out of the gradients and
`record_amax` rolls each history by one with the new amax at its front (index 0 is the newest).

int8 is symmetric, with one scale per output channel for the weight and one per token for the input (every
axis of the input other than the contracted ones keeps its own scale); the product accumulates exactly in
int32 and is rescaled in f32. Its backward is straight-through in the compute dtype, against the dequantized
operands (no int8 gradients).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core import Axis, NamedArray, dot, is_named, permute
from .._ops import max as named_max
from .._tree import Filter, path_str
from .linear import Linear

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
AMAX_HISTORY = "amax_history"
HISTORY_FIELDS = ("input_history", "kernel_history", "grad_history")
SCALINGS = ("delayed", "current")
MODES = ("fp8", "int8")
INT8_MAX = 127.0


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 format (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def quantize_fp8(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
    """x / scale, saturated to the format's range (a plain cast would give NaN above it), cast to fp8."""
    bound = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -bound, bound).astype(dtype)


def amax_scale(amax: jax.Array, dtype: Any) -> jax.Array:
    """The per-tensor scale that maps amax onto the format's largest value; 1 for an all-zero tensor."""
    return jnp.where(amax > 0.0, amax / fp8_max(dtype), 1.0).astype(jnp.float32)


def delayed_amax(history: jax.Array | None, current: jax.Array) -> jax.Array:
    """The amax a delayed scale uses: the history's max, or the current amax while the history is empty."""
    if history is None:
        return current
    seen = jnp.max(history.astype(jnp.float32))
    return jnp.where(seen > 0.0, seen, current)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def _raw(h: NamedArray | None) -> jax.Array | None:
    return None if h is None else h.array


def _seen(h: NamedArray | None, amax: jax.Array) -> NamedArray | None:
    # The cotangent of a history: the amax of this call in every slot, in the history's own dtype.
    return None if h is None else NamedArray(jnp.full(h.array.shape, amax, h.dtype), h.axes)


def _dtype_of(x: NamedArray) -> jax.Array:
    # Residuals must be arrays: an empty one carries the operand's dtype to the backward.
    return jnp.zeros((0,), x.dtype)


def _kept_axes(x: NamedArray, In: tuple[Axis, ...]) -> tuple[str, ...]:
    inside = {a.name for a in In}
    return tuple(a.name for a in x.axes if a.name not in inside)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_dot(In, Out, x, w, hx, hw, hg):
    return _fp8_forward(In, Out, x, w, hx, hw, hg)[0]


def _fp8_forward(In, Out, x, w, hx, hw, hg):
    amax_x, amax_w = _amax(x.array), _amax(w.array)
    sx = amax_scale(delayed_amax(_raw(hx), amax_x), E4M3)
    sw = amax_scale(delayed_amax(_raw(hw), amax_w), E4M3)
    xq = NamedArray(quantize_fp8(x.array, E4M3, sx), x.axes)
    wq = NamedArray(quantize_fp8(w.array, E4M3, sw), w.axes)
    y = dot(xq, wq, axis=In, preferred_element_type=jnp.float32) * (sx * sw)
    return y.astype(x.dtype), (xq, wq, sx, sw, amax_x, amax_w, hx, hw, hg, _dtype_of(x), _dtype_of(w))


def _fp8_fwd(In, Out, x, w, hx, hw, hg):
    return _fp8_forward(In, Out, x, w, hx, hw, hg)


def _fp8_bwd(In, Out, residuals, g):
    xq, wq, sx, sw, amax_x, amax_w, hx, hw, hg, x_like, w_like = residuals
    amax_g = _amax(g.array)
    sg = amax_scale(delayed_amax(_raw(hg), amax_g), E5M2)
    gq = NamedArray(quantize_fp8(g.array, E5M2, sg), g.axes)
    dx = dot(gq, wq, axis=Out, preferred_element_type=jnp.float32) * (sg * sw)
    dw = dot(xq, gq, axis=_kept_axes(xq, In), preferred_element_type=jnp.float32) * (sx * sg)
    dx = permute(dx, xq.axis_names).astype(x_like.dtype)
    dw = permute(dw, wq.axis_names).astype(w_like.dtype)
    return dx, dw, _seen(hx, amax_x), _seen(hw, amax_w), _seen(hg, amax_g)


_fp8_dot.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_dot(
    x: NamedArray,
    w: NamedArray,
    In: tuple[Axis, ...],
    Out: tuple[Axis, ...],
    histories: tuple[NamedArray | None, NamedArray | None, NamedArray | None] = (None, None, None),
) -> NamedArray:
    """x·w contracting In, in fp8 (see the module); histories (input, kernel, grad) or None: current scaling."""
    return _fp8_dot(tuple(In), tuple(Out), x, w, *histories)


def int8_quantize(x: NamedArray, over: Sequence[str]) -> tuple[NamedArray, NamedArray]:
    """Symmetric int8 values and their f32 scales, one scale per slice of the axes not in `over`."""
    amax = named_max(NamedArray(jnp.abs(x.array.astype(jnp.float32)), x.axes), axis=tuple(over))
    scale = NamedArray(jnp.where(amax.array > 0.0, amax.array / INT8_MAX, 1.0), amax.axes)
    q = jnp.clip(jnp.round(x.array.astype(jnp.float32) / permute_like(scale, x)), -INT8_MAX, INT8_MAX)
    return NamedArray(q.astype(jnp.int8), x.axes), scale


def permute_like(scale: NamedArray, x: NamedArray) -> jax.Array:
    """The scale's array broadcast against x's array (size-1 slots where x has axes the scale lacks)."""
    have = set(scale.axis_names)
    ordered = permute(scale, tuple(a for a in x.axis_names if a in have))
    shape = [x.shape[a] if a in have else 1 for a in x.axis_names]
    return ordered.array.reshape(shape)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _int8_dot(In, Out, x, w):
    return _int8_forward(In, x, w)[0]


def _int8_forward(In, x, w):
    names = tuple(a.name for a in In)
    xq, sx = int8_quantize(x, names)
    wq, sw = int8_quantize(w, names)
    acc = dot(xq, wq, axis=In, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * sx * sw
    x_deq = NamedArray(xq.array.astype(jnp.float32) * permute_like(sx, xq), xq.axes)
    w_deq = NamedArray(wq.array.astype(jnp.float32) * permute_like(sw, wq), wq.axes)
    return y.astype(x.dtype), (x_deq, w_deq, _dtype_of(x), _dtype_of(w))


def _int8_fwd(In, Out, x, w):
    return _int8_forward(In, x, w)


def _int8_bwd(In, Out, residuals, g):
    x_deq, w_deq, x_like, w_like = residuals
    g32 = g.astype(jnp.float32)
    dx = permute(dot(g32, w_deq, axis=Out), x_deq.axis_names).astype(x_like.dtype)
    dw = permute(dot(x_deq, g32, axis=_kept_axes(x_deq, In)), w_deq.axis_names).astype(w_like.dtype)
    return dx, dw


_int8_dot.defvjp(_int8_fwd, _int8_bwd)


def int8_dot(x: NamedArray, w: NamedArray, In: tuple[Axis, ...], Out: tuple[Axis, ...]) -> NamedArray:
    """x·w contracting In in int8: per-token input scales, per-output-channel weight scales (see the module)."""
    return _int8_dot(tuple(In), tuple(Out), x, w)


class Fp8Matmul(eqx.Module):
    """A Linear's fp8 matmul; with amax histories (each over `amax_history`, last) it scales delayed."""

    input_history: NamedArray | None = None
    kernel_history: NamedArray | None = None
    grad_history: NamedArray | None = None

    def __call__(self, x: NamedArray, w: NamedArray, In: tuple[Axis, ...], Out: tuple[Axis, ...]) -> NamedArray:
        return fp8_dot(x, w, In, Out, (self.input_history, self.kernel_history, self.grad_history))


class Int8Matmul(eqx.Module):
    """A Linear's int8 matmul (per-token input and per-output-channel weight scales); it keeps no state."""

    def __call__(self, x: NamedArray, w: NamedArray, In: tuple[Axis, ...], Out: tuple[Axis, ...]) -> NamedArray:
        return int8_dot(x, w, In, Out)


def fp8_matmul(linear: Linear, scaling: str = "delayed", history_length: int = 1024) -> Fp8Matmul:
    """The fp8 matmul for one Linear: empty histories (one per stacked layer) when delayed, none when current."""
    if scaling not in SCALINGS:
        raise ValueError(f"fp8 scaling must be one of {list(SCALINGS)}, got {scaling!r}")
    if scaling == "current":
        return Fp8Matmul()
    if isinstance(history_length, bool) or not isinstance(history_length, int) or history_length < 1:
        raise ValueError(f"the amax history length must be a positive integer, got {history_length!r}")
    own = {a.name for a in (*linear.In, *linear.Out)}
    extra = tuple(a for a in linear.weight.axes if a.name not in own)
    axes = (*extra, Axis(AMAX_HISTORY, history_length))
    zeros = jnp.zeros(tuple(a.size for a in axes), jnp.float32)
    return Fp8Matmul(NamedArray(zeros, axes), NamedArray(zeros, axes), NamedArray(zeros, axes))


def _linear_paths(model: Any) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, Linear))
    return [path_str(p) for p, leaf in flat if isinstance(leaf, Linear)]


def quantization_targets(model: Any, targets: str | Sequence[str]) -> list[str]:
    """The paths of the Linear layers `targets` names: a list of names that paths end with, or a regex that
    matches a path from its start (Levanter's rule); a clear error for a name or regex that matches none."""
    paths = _linear_paths(model)
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as e:
            raise ValueError(f"quantization targets {targets!r} is not a valid regular expression: {e}") from None
        chosen = [p for p in paths if pattern.match(p)]
        unmatched = [] if chosen else [targets]
    else:

        def ends(p: str, n: str) -> bool:
            return p == n or p.endswith("." + n)

        chosen = [p for p in paths if any(ends(p, n) for n in targets)]
        unmatched = [n for n in targets if not any(ends(p, n) for p in paths)]
    if unmatched:
        raise ValueError(
            f"quantization targets {unmatched} match no Linear layer of the model. Its Linear layers are: "
            f"{sorted(set(paths))}. Name them by a path suffix (e.g. 'q_proj') or give one regular expression."
        )
    return chosen


def quantize_linears(
    model: Any,
    mode: str,
    targets: str | Sequence[str],
    *,
    scaling: str = "delayed",
    history_length: int = 1024,
) -> Any:
    """The model with the targeted Linear layers computing in `mode` ("fp8" or "int8"); weights unchanged."""
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {list(MODES)}, got {mode!r}")
    chosen = set(quantization_targets(model, targets))

    def visit(path: tuple, leaf: Any) -> Any:
        if not isinstance(leaf, Linear) or path_str(path) not in chosen:
            return leaf
        quant = fp8_matmul(leaf, scaling, history_length) if mode == "fp8" else Int8Matmul()
        return Linear(leaf.weight, leaf.bias, leaf.In, leaf.Out, quant)

    return jax.tree_util.tree_map_with_path(visit, model, is_leaf=lambda x: isinstance(x, Linear))


def plain_linears(model: Any) -> Any:
    """The model with every Linear back on the plain dot (its quantized matmul and amax histories dropped)."""

    def plain(leaf: Any) -> Any:
        return Linear(leaf.weight, leaf.bias, leaf.In, leaf.Out) if isinstance(leaf, Linear) else leaf

    return jax.tree_util.tree_map(plain, model, is_leaf=lambda x: isinstance(x, Linear))


def _is_history(path: str, _leaf: Any) -> bool:
    return path.rsplit(".", 1)[-1] in HISTORY_FIELDS


amax_histories = Filter(_is_history, "amax_histories")
"""Selects the fp8 amax histories of a model (or of its gradients: the amaxes each layer saw)."""


def has_amax_histories(model: Any) -> bool:
    """Whether a model (or a tree of its shapes) keeps fp8 amax histories."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_named)
    return any(_is_history(path_str(p), leaf) for p, leaf in flat)


def record_amax(histories: Any, seen: Any) -> Any:
    """Each history rolled by one with the amax just seen at its front; a non-finite amax is recorded as 0
    (nothing seen), so one overflowing step does not poison the scale for the history's length."""

    def roll(h: Any, s: Any) -> Any:
        if h is None or h.array is None:  # a leaf left out of the histories (an eqx.partition of a model)
            return h
        index = h.axis_index(AMAX_HISTORY)
        newest = jax.lax.slice_in_dim(s.array, 0, 1, axis=index).astype(h.dtype)
        newest = jnp.where(jnp.isfinite(newest), newest, jnp.zeros_like(newest))
        older = jax.lax.slice_in_dim(h.array, 0, h.array.shape[index] - 1, axis=index)
        return NamedArray(jnp.concatenate([newest, older], axis=index), h.axes)

    return jax.tree_util.tree_map(roll, histories, seen, is_leaf=lambda x: x is None or is_named(x))
