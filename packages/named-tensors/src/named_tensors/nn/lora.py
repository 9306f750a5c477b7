"""LoRA: low-rank adapters on the named Linear layers of any equinox model, merged back or trained alone.

`apply_lora(model, config, key=...)` wraps every targeted `Linear` in a `LoraLinear`:
y = W x + b + (alpha / r) B A dropout(x), with A over axes (lora_rank, *In) and B over (*Out, lora_rank), so
the adapters shard by axis name like the weight they adapt (a stacked weight's leading `layers` axis leads
theirs too). A starts like PEFT's (uniform in +-1/sqrt(fan_in)) and B at zero, so the wrapped model computes
exactly what the base model does until B is trained. `lora_params` selects the adapters (for the optimizer and
checkpoints), `merge_lora` folds them into the base weights.

Dropout (on the adapters' input) needs a key per step: the layers that call a Linear pass none, so the key
lives on each LoraLinear, set with `with_lora_dropout_keys(model, key)` before a training step (and cleared
with key=None for evaluation); without a key the adapters run without dropout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._core import Axis, NamedArray, dot, permute
from .._tree import Filter, path_str
from .dropout import Dropout
from .linear import Linear

LORA_RANK = "lora_rank"
ADAPTER_FIELDS = ("lora_a", "lora_b")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA settings, as PEFT names them: rank r, scale alpha / r, dropout, and the Linear layers to adapt.

    `target_modules` is a list of names, each matching a Linear whose dotted path ends with it (e.g. "q_proj"
    or "self_attn.q_proj"), or one regular expression that must match a Linear's whole dotted path.
    """

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be a positive integer rank, got {self.r!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be positive (the adapters are scaled by alpha / r), got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; name the Linear layers to adapt (e.g. [q_proj, v_proj])")

    @property
    def scale(self) -> float:
        return self.alpha / self.r


class LoraLinear(eqx.Module):
    """A Linear plus a low-rank update: base(x) + scale * B A dropout(x)."""

    base: Linear
    lora_a: NamedArray  # (*extra, lora_rank, *In); extra: the base weight's leading axes beyond Out and In
    lora_b: NamedArray  # (*extra, *Out, lora_rank)
    dropout_key: jax.Array | None = None  # typed PRNG key(s), shaped like the extra axes
    scale: float = eqx.field(static=True, default=1.0)
    dropout: float = eqx.field(static=True, default=0.0)

    @property
    def In(self) -> tuple[Axis, ...]:
        return self.base.In

    @property
    def Out(self) -> tuple[Axis, ...]:
        return self.base.Out

    @property
    def Rank(self) -> Axis:
        return self.lora_a.resolve_axis(LORA_RANK)

    @property
    def weight(self) -> NamedArray:
        """The effective weight W + scale B A, for code that reads a Linear's weight (e.g. an output head).

        That path computes the full update and applies no dropout; calling the layer does neither.
        """
        return self.base.weight + self.delta().astype(self.base.weight.dtype)

    @property
    def bias(self) -> NamedArray | None:
        return self.base.bias

    def __call__(self, x: NamedArray, *, key: jax.Array | None = None) -> NamedArray:
        """The base layer's output plus the adapters'; `key` (or the stored dropout key) turns dropout on."""
        y = self.base(x)
        key = self.dropout_key if key is None else key
        if self.dropout > 0.0 and key is not None:
            x = Dropout(self.dropout)(x, key=key)
        low = dot(x, self.lora_a, axis=self.In)
        update = dot(low, self.lora_b, axis=LORA_RANK)
        return y + update * jnp.asarray(self.scale, update.dtype)

    def delta(self) -> NamedArray:
        """scale * B A, over the base weight's axes in its order."""
        update = dot(self.lora_b, self.lora_a, axis=LORA_RANK) * jnp.asarray(self.scale, self.lora_a.dtype)
        return permute(update, self.base.weight.axis_names)

    def merged(self) -> Linear:
        """The plain Linear with the update folded into its weight."""
        return Linear(self.weight, self.base.bias, self.base.In, self.base.Out)


def _is_linear(x: Any) -> bool:
    return isinstance(x, Linear | LoraLinear)


def linear_paths(model: Any) -> list[str]:
    """The dotted paths of every Linear (or LoraLinear) in the model, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)
    return [path_str(p) for p, leaf in flat if _is_linear(leaf)]


def target_matcher(target_modules: str | Sequence[str]) -> Any:
    """A predicate on dotted paths: regex full match (a string) or a path ending in a listed name (a list)."""
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise ValueError(f"lora.target_modules {target_modules!r} is not a valid regular expression: {e}") from None
        return lambda path: pattern.fullmatch(path) is not None
    names = tuple(target_modules)
    return lambda path: any(path == n or path.endswith("." + n) for n in names)


def select_targets(model: Any, target_modules: str | Sequence[str]) -> list[str]:
    """The paths of the Linear layers that target_modules names; a clear error for a name that matches none."""
    paths = linear_paths(model)
    matches = target_matcher(target_modules)
    chosen = [p for p in paths if matches(p)]
    if isinstance(target_modules, str):
        unmatched = [] if chosen else [target_modules]
    else:
        unmatched = [n for n in target_modules if not any(target_matcher([n])(p) for p in paths)]
    if unmatched:
        raise ValueError(
            f"lora.target_modules {unmatched} match no Linear layer of the model. Its Linear layers are: "
            f"{sorted(set(paths))}. Name them by a path suffix (e.g. 'q_proj') or give one regular expression "
            "that matches whole paths."
        )
    return chosen


def _extra_axes(linear: Linear) -> tuple[Axis, ...]:
    own = {a.name for a in (*linear.In, *linear.Out)}
    extra = tuple(a for a in linear.weight.axes if a.name not in own)
    if linear.weight.axes[: len(extra)] != extra:
        raise ValueError(
            f"LoRA needs a Linear's extra weight axes (e.g. a stack's `layers`) to lead; got {linear.weight.axes}"
        )
    return extra


def lora_linear(linear: Linear, config: LoraConfig, *, key: jax.Array) -> LoraLinear:
    """Wrap one Linear: A uniform in +-1/sqrt(fan_in) (PEFT's default), B zero."""
    if isinstance(linear, LoraLinear):
        raise ValueError("this Linear already has LoRA adapters; merge_lora first to adapt it again")
    extra = _extra_axes(linear)
    Rank = Axis(LORA_RANK, config.r)
    fan_in = math.prod(a.size for a in linear.In)
    bound = 1.0 / math.sqrt(fan_in)
    a_axes = (*extra, Rank, *linear.In)
    b_axes = (*extra, *linear.Out, Rank)
    dtype = linear.weight.dtype
    values = jax.random.uniform(key, tuple(a.size for a in a_axes), jnp.float32, -bound, bound)
    lora_a = NamedArray(values.astype(dtype), a_axes)
    lora_b = NamedArray(jnp.zeros(tuple(a.size for a in b_axes), dtype), b_axes)
    return LoraLinear(linear, lora_a, lora_b, None, config.scale, config.dropout)


def _map_linears(model: Any, fn: Any) -> Any:
    """model with fn(path, index, layer) in place of each Linear/LoraLinear (index: its position in tree order)."""
    counter = iter(range(1 << 30))

    def visit(path: tuple, leaf: Any) -> Any:
        return fn(path_str(path), next(counter), leaf) if _is_linear(leaf) else leaf

    return jax.tree_util.tree_map_with_path(visit, model, is_leaf=_is_linear)


def apply_lora(model: Any, config: LoraConfig, *, key: jax.Array) -> Any:
    """The model with LoRA adapters on the Linear layers that config.target_modules names."""
    targets = set(select_targets(model, config.target_modules))

    def wrap(path: str, index: int, layer: Any) -> Any:
        if path not in targets:
            return layer
        return lora_linear(layer, config, key=jax.random.fold_in(key, index))

    return _map_linears(model, wrap)


def merge_lora(model: Any) -> Any:
    """The model with every LoraLinear replaced by its merged Linear (the same function, plain weights)."""
    return _map_linears(model, lambda _p, _i, layer: layer.merged() if isinstance(layer, LoraLinear) else layer)


def with_lora_dropout_keys(model: Any, key: jax.Array | None) -> Any:
    """The model with a fresh dropout key on each LoraLinear (one per stacked layer), or none (key=None)."""

    def set_key(_path: str, index: int, layer: Any) -> Any:
        if not isinstance(layer, LoraLinear) or layer.dropout == 0.0:
            return layer
        if key is None:
            return eqx.tree_at(lambda m: m.dropout_key, layer, None, is_leaf=lambda x: x is None)
        extra = _extra_axes(layer.base)
        keys = jax.random.split(jax.random.fold_in(key, index), tuple(a.size for a in extra)) if extra else None
        new = keys if keys is not None else jax.random.fold_in(key, index)
        return eqx.tree_at(lambda m: m.dropout_key, layer, new, is_leaf=lambda x: x is None)

    return _map_linears(model, set_key)


def lora_paths(model: Any) -> list[str]:
    """The dotted paths of the LoraLinear layers of a model."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)
    return [path_str(p) for p, leaf in flat if isinstance(leaf, LoraLinear)]


lora_params = Filter(lambda path, _leaf: path.rsplit(".", 1)[-1] in ADAPTER_FIELDS, "lora_params")
"""Selects the adapter weights (lora_a, lora_b) of a model: `nt.partition(model, lora_params)`."""
