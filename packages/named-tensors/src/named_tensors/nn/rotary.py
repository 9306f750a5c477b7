"""Rotary position embeddings (RoPE) in Hugging Face's rotate-half layout, with linear, llama3, dynamic-NTK and
YaRN scaling.

Layout: the head size is split in two halves, and feature i of the first half rotates with feature
i + head_size/2 at frequency inv_freq[i] (HF Llama's `rotate_half`, not the interleaved pairs of the
original paper), so Hugging Face q/k projection weights load without any permutation. With `interleaved`,
features 2i and 2i + 1 rotate together instead (the complex pairs of Meta's Llama 4 and of the original paper).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jax import Array

from .._core import Axis, AxisSelector, NamedArray, axis_name, permute


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation: every frequency divided by `factor`."""

    factor: float


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent scaling: long wavelengths / factor, short ones kept, smooth between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class DynamicNtkRopeScaling:
    """Dynamic NTK: past `max_position_embeddings` positions, theta grows with the sequence length seen.

    The length is one past the largest position id of the call (for a decoding step, the sequence so far), as
    in transformers' "dynamic" rope type.
    """

    factor: float
    max_position_embeddings: int


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN: frequencies blended between interpolated and original by a ramp over the dimensions, and cos/sin
    scaled by an attention factor (from `factor`, or `mscale` / `mscale_all_dim`, unless given)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


RopeScaling = LinearRopeScaling | Llama3RopeScaling | DynamicNtkRopeScaling | YarnRopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: YarnRopeScaling) -> float:
    """The factor YaRN multiplies cos and sin by."""
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def _yarn_inverse_frequencies(theta: float, head_size: int, s: YarnRopeScaling) -> Array:
    # transformers' _compute_yarn_parameters, step for step: the correction range in Python floats, the
    # frequencies in float32.
    def correction_dim(rotations: float) -> float:
        return (
            head_size * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = jnp.float32(theta) ** (jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = jnp.clip((jnp.arange(head_size // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3_inverse_frequencies(inv_freq: Array, s: Llama3RopeScaling) -> Array:
    # The same arithmetic, in the same order and in float32, as transformers' _compute_llama3_parameters
    # (the results agree to 1 ulp: XLA and torch round pow and division differently).
    old_context = float(s.original_max_position_embeddings)
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    # Equal factors (Llama 4 Scout's) leave no band to blend: is_medium is then false but at one exact wavelength,
    # where transformers divides by zero; a span of one keeps that value finite.
    span = (s.high_freq_factor - s.low_freq_factor) or 1.0
    smooth = (old_context / wavelen - s.low_freq_factor) / span
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


class RotaryEmbeddings(eqx.Module):
    """RoPE configuration (no parameters): head size, base theta, an optional scaling, and the pair layout
    (rotate-half, or interleaved pairs)."""

    head_size: int = eqx.field(static=True)
    theta: float = eqx.field(static=True, default=10000.0)
    scaling: RopeScaling | None = eqx.field(static=True, default=None)
    interleaved: bool = eqx.field(static=True, default=False)

    def __check_init__(self) -> None:
        if self.head_size <= 0 or self.head_size % 2:
            raise ValueError(f"Rotary embeddings need a positive, even head size, got {self.head_size}")
        if self.theta <= 0:
            raise ValueError(f"Rotary theta must be positive, got {self.theta}")
        if isinstance(self.scaling, Llama3RopeScaling) and self.scaling.high_freq_factor < (
            self.scaling.low_freq_factor
        ):
            raise ValueError("llama3 rope scaling needs high_freq_factor >= low_freq_factor")
        if self.scaling is not None and not isinstance(self.scaling, RopeScaling):
            raise TypeError(
                f"Unknown rope scaling {self.scaling!r}; use LinearRopeScaling, Llama3RopeScaling, "
                "DynamicNtkRopeScaling or YarnRopeScaling"
            )

    @staticmethod
    def from_hf_config(
        head_size: int, rope_theta: float | None = None, rope_scaling: Mapping[str, Any] | None = None
    ) -> RotaryEmbeddings:
        """From Hugging Face config values: `rope_theta` and `rope_scaling` (transformers < 5, with
        `rope_type` or `type`) or the `rope_parameters` dict of transformers 5 (which holds rope_theta)."""
        rope_scaling = dict(rope_scaling or {})
        if rope_theta is None:
            if "rope_theta" not in rope_scaling:
                raise ValueError("RotaryEmbeddings.from_hf_config needs rope_theta (argument or dict key)")
            rope_theta = rope_scaling["rope_theta"]
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings"), "dynamic": ("factor", "max_position_embeddings"),
                  "yarn": ("factor", "original_max_position_embeddings")}.get(kind, ())  # fmt: skip
        missing = [k for k in needed if rope_scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope scaling of type {kind!r} needs {missing} in rope_scaling={rope_scaling}")
        if kind == "default":
            scaling = None
        elif kind == "linear":
            scaling = LinearRopeScaling(float(rope_scaling["factor"]))
        elif kind == "llama3":
            scaling = Llama3RopeScaling(
                float(rope_scaling["factor"]),
                float(rope_scaling["low_freq_factor"]),
                float(rope_scaling["high_freq_factor"]),
                int(rope_scaling["original_max_position_embeddings"]),
            )
        elif kind == "dynamic":
            scaling = DynamicNtkRopeScaling(float(rope_scaling["factor"]), int(rope_scaling["max_position_embeddings"]))
        elif kind == "yarn":
            names = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
            optional = {k: rope_scaling[k] for k in names if rope_scaling.get(k) is not None}
            scaling = YarnRopeScaling(
                float(rope_scaling["factor"]), int(rope_scaling["original_max_position_embeddings"]), **optional
            )
        else:
            raise ValueError(
                f"Unsupported rope scaling type {kind!r} in rope_scaling={rope_scaling}; "
                "supported: default, linear, llama3, dynamic, yarn"
            )
        assert rope_theta is not None  # given, or read from the dict above
        return RotaryEmbeddings(head_size, float(rope_theta), scaling)

    def inverse_frequencies(self, seq_len: Array | int | None = None) -> Array:
        """float32 array of head_size/2 angular frequencies, after scaling.

        `seq_len` (possibly traced) is the sequence length that dynamic-NTK scaling adapts to; other scalings
        ignore it.
        """
        exponents = jnp.arange(0, self.head_size, 2, dtype=jnp.float32) / self.head_size
        theta = jnp.float32(self.theta)
        if isinstance(self.scaling, DynamicNtkRopeScaling):
            s = self.scaling
            length = jnp.maximum(
                jnp.asarray(seq_len if seq_len is not None else 0, jnp.int32), s.max_position_embeddings
            )
            growth = s.factor * length.astype(jnp.float32) / s.max_position_embeddings - (s.factor - 1)
            theta = theta * growth ** (self.head_size / (self.head_size - 2))
        if isinstance(self.scaling, YarnRopeScaling):
            return _yarn_inverse_frequencies(self.theta, self.head_size, self.scaling)
        inv_freq = 1.0 / (theta**exponents)
        if isinstance(self.scaling, LinearRopeScaling):
            return inv_freq / self.scaling.factor
        if isinstance(self.scaling, Llama3RopeScaling):
            return _llama3_inverse_frequencies(inv_freq, self.scaling)
        return inv_freq

    def attention_factor(self) -> float:
        """The factor cos and sin are multiplied by (YaRN's; 1 for the other scalings)."""
        return yarn_attention_factor(self.scaling) if isinstance(self.scaling, YarnRopeScaling) else 1.0

    def cos_sin(self, position_ids: NamedArray, HeadSize: AxisSelector = "head_size") -> tuple[NamedArray, NamedArray]:
        """float32 cos and sin of the rotation angles, with axes (*position_ids.axes, HeadSize)."""
        if not isinstance(position_ids, NamedArray) or not jnp.issubdtype(position_ids.dtype, jnp.integer):
            raise TypeError(f"Rotary embeddings need integer position ids as a NamedArray, got {position_ids!r}")
        Size = Axis(axis_name(HeadSize), self.head_size)
        seq_len = None
        if isinstance(self.scaling, DynamicNtkRopeScaling):
            seq_len = jnp.max(position_ids.array).astype(jnp.int32) + 1
        inv_freq = self.inverse_frequencies(seq_len).reshape((1,) * position_ids.ndim + (-1,))
        angles = position_ids.array.astype(jnp.float32)[..., None] * inv_freq
        # Pair i is features (i, i + head_size/2), or with `interleaved` features (2i, 2i + 1).
        both = jnp.repeat(angles, 2, axis=-1) if self.interleaved else jnp.concatenate([angles, angles], axis=-1)
        angles = both
        axes = (*position_ids.axes, Size)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        factor = self.attention_factor()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return NamedArray(cos, axes), NamedArray(sin, axes)

    def __call__(self, x: NamedArray, position_ids: NamedArray, *, HeadSize: AxisSelector = "head_size") -> NamedArray:
        """Rotate x (e.g. queries or keys) by the angles of position_ids; axes and dtype are kept.

        position_ids carries x's position axis (and optionally batch), e.g. (position,) for queries and
        (key_position,) for keys.
        """
        if not isinstance(x, NamedArray):
            raise TypeError(f"Rotary embeddings take a NamedArray, got {type(x).__name__}")
        if x.axis_size(HeadSize) != self.head_size:
            raise ValueError(f"x has {axis_name(HeadSize)}={x.axis_size(HeadSize)}, rotary expects {self.head_size}")
        unknown = [n for n in position_ids.axis_names if not x.has_axis(n)]
        if unknown:
            raise ValueError(
                f"position_ids axes {unknown} are not axes of x {x.axis_names}; name the position ids "
                "with x's own position axis (e.g. 'key_position' for keys)"
            )
        cos, sin = self.cos_sin(position_ids, HeadSize)
        return rotate(x, cos, sin, HeadSize=HeadSize, interleaved=self.interleaved)


def rotate(
    x: NamedArray,
    cos: NamedArray,
    sin: NamedArray,
    *,
    HeadSize: AxisSelector = "head_size",
    interleaved: bool = False,
) -> NamedArray:
    """Rotate x by precomputed angles (RotaryEmbeddings.cos_sin, of the same `interleaved` layout); axes and dtype
    are kept.

    For layers that pick between several rotary settings at run time (e.g. Gemma 3's local and global layers in
    one scan), compute each one's cos/sin and select before rotating.
    """
    # Like Hugging Face: angles in float32, cos/sin cast to the input dtype, rotation in that dtype.
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    turned = _rotate_pairs(x, HeadSize) if interleaved else _rotate_half(x, HeadSize)
    rotated = x * cos + turned * sin
    return permute(rotated, x.axis_names)


def _rotate_half(x: NamedArray, HeadSize: AxisSelector) -> NamedArray:
    """(x1, x2) -> (-x2, x1) over the two halves of HeadSize."""
    moved = permute(x, (..., axis_name(HeadSize)))
    first, second = jnp.split(moved.array, 2, axis=-1)
    return NamedArray(jnp.concatenate([-second, first], axis=-1), moved.axes)


def _rotate_pairs(x: NamedArray, HeadSize: AxisSelector) -> NamedArray:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): each interleaved pair times i, as a complex number."""
    moved = permute(x, (..., axis_name(HeadSize)))
    pairs = moved.array.reshape(*moved.array.shape[:-1], -1, 2)
    turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(moved.array.shape)
    return NamedArray(turned, moved.axes)
