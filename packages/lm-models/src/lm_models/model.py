"""LmHeadModel: the interface every model family implements (logits, activations, KV-cached decoding)."""

from __future__ import annotations

import abc
import dataclasses
import operator
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

import named_tensors as nt
from named_tensors import Axis, NamedArray

from .kv_cache import KVCache

if TYPE_CHECKING:
    from .config import LmConfig

POSITION = "position"


class LmHeadModel(eqx.Module):
    """A causal language model: token ids (..., position) in, logits (..., position, vocab) out."""

    # Subclasses declare these static fields (not annotated here: base-class fields would come first in
    # the subclasses' __init__ and force defaults on every parameter field): `config`, the LmConfig;
    # `Vocab`, the logits' vocabulary Axis; and `inference`, a bool that turns dropout off (static so that
    # plain jax.jit over the model works; flip it with lm_models.inference_mode(model)).
    if TYPE_CHECKING:  # declared for type checkers as read-only properties, which make no dataclass fields

        @property
        def config(self) -> LmConfig: ...
        @property
        def Vocab(self) -> Axis: ...
        @property
        def inference(self) -> bool: ...

    @abc.abstractmethod
    def activations(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        cache: Any = None,
        cache_offset: jax.Array | int = 0,
    ) -> tuple[NamedArray, Any]:
        """Final hidden states (..., position, embed) before the output head, and the updated cache."""

    @abc.abstractmethod
    def unembedding(self) -> NamedArray:
        """The output head's weight, axes (vocab, embed): logits = hidden · weight over embed."""

    def init_cache(self, batch_axes: tuple[Axis, ...], max_length: int, dtype: Any = jnp.float32) -> Any:
        """An empty decoding cache with room for max_length positions per sequence: by default zeroed keys/values
        for every layer of the stack, axes (layers, *batch_axes, key_position, kv_heads, head_size)."""
        return layer_stack_cache(self.config, batch_axes, max_length, dtype)

    def activations_and_aux(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        positions: NamedArray | None = None,
        router_load: bool = False,
    ) -> tuple[NamedArray, dict[str, jax.Array]]:
        """Final hidden states and the model's auxiliary losses: a dict of unweighted float32 scalars, such as
        a mixture of experts' {"router_aux_loss": ...}; {} for a model without any. The config's
        aux_loss_weights() says how much each adds to the training loss (see lm_models.next_token_loss).
        With router_load, a mixture also reports nt.nn.ROUTER_LOAD: its sparse layers' expert loads
        (layers, experts), each row the fraction of routed choices per expert."""
        # Holds only `positions`, passed only when given (MPT and Backpack take no such keyword).
        extra: dict[str, Any] = {} if positions is None else {"positions": positions}
        hidden, _ = self.activations(input_ids, attn_mask, key=key, **extra)
        return hidden, {}

    def for_export(self) -> Any:
        """The model as a Hugging Face checkpoint holds it: itself, unless a family has training-only parts that
        its checkpoints leave out (none does now: DeepSeek-V3's multi-token prediction depths are exported)."""
        return self

    def balances_routing(self) -> bool:
        """Whether the train step moves routing biases from the experts' load outside the gradient (DeepSeek-V3's
        aux-loss-free balancing, through balance_routing and routing_biases); false for most models."""
        return False

    def routing_biases(self) -> list[NamedArray]:
        """The routers' correction biases that balance_routing moves; none by default."""
        return []

    def balance_routing(self, before: Any, load: jax.Array) -> Any:
        """This model (a step's updated weights) with its routing biases moved from `before`'s by the load
        (layers, experts) of the step; only a model whose balances_routing() is true has any."""
        raise TypeError(f"{type(self).__name__} has no routing biases to balance")

    def logits_soft_cap(self) -> float | None:
        """The cap of a final cap * tanh(logits / cap) that logits_from_activations applies, or None."""
        return None

    def layer_stack(self) -> Any:
        """The stack of like layers between the embedding and the head that a run may split into pipeline stages:
        an nt.Stacked or nt.BlockSeq whose scan(x, mask, positions, ...) the model calls once, or None."""
        return None

    def with_layer_stack(self, stack: Any) -> Any:
        """The same model with `stack` (anything with layer_stack()'s scan) in place of its layer stack."""
        raise TypeError(f"{type(self).__name__} exposes no layer stack (its layer_stack() is None)")

    def __call__(
        self,
        input_ids: NamedArray,
        attn_mask: NamedArray | None = None,
        *,
        key: jax.Array | None = None,
        positions: NamedArray | None = None,
    ) -> NamedArray:
        """Logits over the vocabulary at every position; key=None runs without dropout.

        `positions` (integer, over input_ids' axes) replaces 0, 1, 2, ... as each token's position, e.g. to
        restart at every document of a packed sequence (with nt.nn.packed_causal_mask as attn_mask); families
        whose activations take a `positions` keyword support it (all but MPT and Backpack).
        """
        # Holds only `positions`, passed only when given (MPT and Backpack take no such keyword).
        extra: dict[str, Any] = {} if positions is None else {"positions": positions}
        hidden, _ = self.activations(input_ids, attn_mask, key=key, **extra)
        return self.logits_from_activations(hidden)

    def logits_from_activations(self, hidden: NamedArray) -> NamedArray:
        """Apply the output head to hidden states (..., position, embed)."""
        head = self.unembedding().astype(hidden.dtype)
        logits = nt.dot(hidden, head, axis=self.config.Embed)
        # named-tensors' permute takes `...` (its docstring says so); its annotation does not yet.
        return nt.permute(logits, (..., POSITION, self.Vocab))

    def decode(self, input_ids: NamedArray, cache: Any, cache_offset: jax.Array | int) -> tuple[NamedArray, Any]:
        """Logits for input_ids placed at positions cache_offset... of a cached sequence, and the new cache."""
        hidden, cache = self.activations(input_ids, None, key=None, cache=cache, cache_offset=cache_offset)
        return self.logits_from_activations(hidden), cache


class TiedHeadModel(LmHeadModel):
    """A model whose output head is its token embedding table (GPT-2, MPT, Backpack): no head weights of its own."""

    # The attribute path of the token Embedding that the head reuses (e.g. "wte"); each model names its own.
    tied_embeddings: ClassVar[str]

    def unembedding(self) -> NamedArray:
        """The tied head: the token embedding table (vocab, embed)."""
        return operator.attrgetter(self.tied_embeddings)(self).weight


def check_input_ids(input_ids: Any, max_positions: int | None) -> NamedArray:
    """Raise a clear error unless input_ids is an integer NamedArray with a position axis that fits."""
    if not isinstance(input_ids, NamedArray):
        raise TypeError(
            "input_ids must be a NamedArray with a 'position' axis (and optionally 'batch'), e.g. "
            f"nt.named(ids, ('batch', 'position')); got {type(input_ids).__name__}"
        )
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if not input_ids.has_axis(POSITION):
        raise ValueError(f"input_ids needs a {POSITION!r} axis; it has axes {input_ids.axis_names}")
    length = input_ids.axis_size(POSITION)
    if max_positions is not None and length > max_positions:
        raise ValueError(
            f"input_ids has {length} positions but the model was built for seq_len={max_positions}; "
            "raise seq_len in the config or pass shorter sequences"
        )
    return input_ids


def absolute_positions(input_ids: NamedArray, cache_offset: jax.Array | int) -> NamedArray:
    """The absolute position of each slot of input_ids' position axis, starting at cache_offset."""
    Pos = input_ids.resolve_axis(POSITION)
    return nt.arange(Pos, dtype=jnp.int32) + jnp.asarray(cache_offset, jnp.int32)


def given_positions(input_ids: NamedArray, positions: NamedArray | None, cache_offset: jax.Array | int) -> NamedArray:
    """`positions` when given (checked against input_ids' axes), else the absolute positions from cache_offset."""
    if positions is None:
        return absolute_positions(input_ids, cache_offset)
    if not isinstance(positions, NamedArray) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be an integer NamedArray over input_ids' axes, got {positions!r}")
    if not positions.has_axis(POSITION) or any(not input_ids.has_axis(a.name) for a in positions.axes):
        raise ValueError(f"positions has axes {positions.axis_names}; it needs input_ids' axes {input_ids.axis_names}")
    return positions.astype(jnp.int32)


def batch_axes_of(input_ids: NamedArray) -> tuple[Axis, ...]:
    """input_ids' axes other than position: the axes a cache keeps one sequence per entry of."""
    return tuple(a for a in input_ids.axes if a.name != POSITION)


def stacked_cache(Layers: Axis, one_layer: KVCache) -> KVCache:
    """A per-layer cache repeated along a leading Layers axis (for nt.Stacked's per-layer inputs)."""
    return jax.tree.map(
        lambda x: nt.broadcast_to(x, (Layers, *x.axes)), one_layer, is_leaf=lambda x: isinstance(x, NamedArray)
    )


def layer_stack_cache(config: Any, batch_axes: tuple[Axis, ...], max_length: int, dtype: Any) -> KVCache:
    """Zeroed keys/values for every layer: axes (layers, *batch_axes, key_position, kv_heads, head_size)."""
    one = KVCache.zeros(batch_axes, Axis("key_position", max_length), config.KVHeads, config.HeadSize, dtype=dtype)
    return stacked_cache(config.Layers, one)


def run_layer_stack(
    blocks: nt.Stacked | nt.BlockSeq,
    x: NamedArray,
    attn_mask: NamedArray | None,
    positions: NamedArray,
    *,
    key: jax.Array | None,
    cache: KVCache | None,
    cache_offset: jax.Array | int,
    inference: bool,
    per_layer: dict[str, Any] | None = None,
) -> tuple[NamedArray, KVCache | None]:
    """x through every block, each given its layer's slice of `per_layer` and of the cache; the updated cache."""
    # Pin activations to the current compute mapping (a no-op outside nt.axis_mapping).
    x = nt.shard(x)
    per_layer = dict(per_layer or {})
    if cache is not None:
        per_layer["cache"] = cache
    x, new_cache = blocks.scan(
        x, attn_mask, positions, key=key, per_layer=per_layer, inference=inference, cache_offset=cache_offset
    )
    return x, (new_cache if cache is not None else None)


def inference_mode(model: LmHeadModel, value: bool = True) -> LmHeadModel:
    """A copy of the model with dropout off (value=True) or on (value=False); parameters are shared."""
    return dataclasses.replace(model, inference=value)


def dropout(x: NamedArray, rate: float, key: jax.Array | None, inference: bool) -> NamedArray:
    """Dropout that is off when rate is 0, in inference mode, or when no key is given."""
    if rate == 0.0 or inference or key is None:
        return x
    return nt.nn.Dropout(rate)(x, key=key)


def split_key(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    """n independent keys from key, or n Nones when key is None."""
    if key is None:
        return [None] * n
    return list(jax.random.split(key, n))
